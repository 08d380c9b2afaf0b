/* common/list.h — intrusive doubly linked list (as UCX's ucs_list and the Linux kernel's list_head).
 *
 * An element embeds a pd_list_link_t; a list is a pd_list_link_t head whose prev/next point to
 * itself when empty. Insertion and removal are O(1) with no allocation and no search, so code that
 * drops an element from the middle of a list no longer walks a `T **pp` to find its predecessor.
 *
 *     typedef struct lease { ...; pd_list_link_t link; } lease_t;
 *     pd_list_link_t leases;                       // head
 *     pd_list_head_init(&leases);
 *     pd_list_add_tail(&leases, &l->link);
 *     lease_t *l, *tmp;
 *     pd_list_for_each_safe(l, tmp, &leases, link) { if (done(l)) { pd_list_del(&l->link); free(l); } }
 *
 * No locking: the owner of the head guards it (say which mutex in the struct's comment). */
#ifndef PD_COMMON_LIST_H
#define PD_COMMON_LIST_H

#include <stdbool.h>
#include <stddef.h>

typedef struct pd_list_link {
    struct pd_list_link *prev, *next;
} pd_list_link_t;

/* The struct of type `type` whose member `member` is at ptr. */
#define pd_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* An empty list (or an unlinked element: pd_list_del leaves it so). */
static inline void pd_list_head_init(pd_list_link_t *head)
{
    head->prev = head->next = head;
}

static inline bool pd_list_is_empty(const pd_list_link_t *head)
{
    return head->next == head;
}

/* Links elem between prev and next (internal). */
static inline void pd_list_insert_between(pd_list_link_t *prev, pd_list_link_t *next, pd_list_link_t *elem)
{
    elem->prev = prev;
    elem->next = next;
    prev->next = elem;
    next->prev = elem;
}

/* Inserts elem first / last. elem must not be on a list. */
static inline void pd_list_add_head(pd_list_link_t *head, pd_list_link_t *elem)
{
    pd_list_insert_between(head, head->next, elem);
}

static inline void pd_list_add_tail(pd_list_link_t *head, pd_list_link_t *elem)
{
    pd_list_insert_between(head->prev, head, elem);
}

/* Unlinks elem from whatever list holds it and leaves it as an empty list, so a second
 * pd_list_del of the same element is harmless. */
static inline void pd_list_del(pd_list_link_t *elem)
{
    elem->prev->next = elem->next;
    elem->next->prev = elem->prev;
    pd_list_head_init(elem);
}

/* Moves every element of src to the end of dst, in order; src is left empty. */
static inline void pd_list_splice_tail(pd_list_link_t *dst, pd_list_link_t *src)
{
    if (pd_list_is_empty(src)) {
        return;
    }
    pd_list_link_t *first = src->next, *last = src->prev;
    first->prev = dst->prev;
    dst->prev->next = first;
    last->next = dst;
    dst->prev = last;
    pd_list_head_init(src);
}

static inline size_t pd_list_length(const pd_list_link_t *head)
{
    size_t n = 0;
    for (const pd_list_link_t *e = head->next; e != head; e = e->next) {
        n++;
    }
    return n;
}

/* The first / last element (of type `type`, linked through `member`); the list must not be empty. */
#define pd_list_head(head, type, member) pd_container_of((head)->next, type, member)
#define pd_list_tail(head, type, member) pd_container_of((head)->prev, type, member)

/* Iterates elem (a `type *` variable) over the list, first to last. The body must not unlink elem. */
#define pd_list_for_each(elem, head, member)                                                                 \
    for ((elem) = pd_container_of((head)->next, __typeof__(*(elem)), member); &(elem)->member != (head);     \
         (elem) = pd_container_of((elem)->member.next, __typeof__(*(elem)), member))

/* The same, and the body may unlink (and free) elem; tmp is a second `type *` variable. */
#define pd_list_for_each_safe(elem, tmp, head, member)                                                       \
    for ((elem) = pd_container_of((head)->next, __typeof__(*(elem)), member),                                \
        (tmp) = pd_container_of((elem)->member.next, __typeof__(*(elem)), member);                           \
         &(elem)->member != (head);                                                                          \
         (elem) = (tmp), (tmp) = pd_container_of((elem)->member.next, __typeof__(*(elem)), member))

/* Unlinks and returns the first link, or NULL when the list is empty. */
static inline pd_list_link_t *pd_list_pop_link(pd_list_link_t *head)
{
    if (pd_list_is_empty(head)) {
        return NULL;
    }
    pd_list_link_t *e = head->next;
    pd_list_del(e);
    return e;
}

static inline void *pd_list_entry_or_null_(pd_list_link_t *link, size_t offset)
{
    return link != NULL ? (char *)link - offset : NULL;
}

/* Unlinks and returns the first element (a `type *`), or NULL when the list is empty. */
#define pd_list_pop_head(head, type, member)                                                                 \
    ((type *)pd_list_entry_or_null_(pd_list_pop_link(head), offsetof(type, member)))

#endif
