/* common/arena.c — bump allocator. */
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct pd_arena_chunk {
    pd_arena_chunk_t *next;
    size_t cap; /* bytes of data[] */
    size_t used;
    unsigned char data[]; /* malloc alignment; pd_arena_alloc aligns absolute addresses */
};

void pd_arena_init(pd_arena_t *arena, size_t chunk_size)
{
    arena->head = NULL;
    arena->chunk_size = chunk_size != 0 ? chunk_size : 64 * 1024;
    arena->bytes_used = 0;
}

void *pd_arena_alloc(pd_arena_t *arena, size_t size, size_t align)
{
    if (align == 0 || (align & (align - 1)) != 0 || align > 4096) {
        return NULL;
    }
    pd_arena_chunk_t *c = arena->head;
    if (c != NULL) {
        uintptr_t base = (uintptr_t)c->data;
        size_t off = (size_t)(((base + c->used + align - 1) & ~(uintptr_t)(align - 1)) - base);
        if (off <= c->cap && size <= c->cap - off) {
            c->used = off + size;
            arena->bytes_used += size;
            return c->data + off;
        }
    }
    if (size > SIZE_MAX - align - sizeof(pd_arena_chunk_t)) {
        return NULL;
    }
    size_t cap = size + align > arena->chunk_size ? size + align : arena->chunk_size;
    pd_arena_chunk_t *n = malloc(sizeof(*n) + cap);
    if (n == NULL) {
        return NULL;
    }
    n->cap = cap;
    uintptr_t base = (uintptr_t)n->data;
    size_t off = ((base + align - 1) & ~(uintptr_t)(align - 1)) - base;
    n->used = off + size;
    if (c != NULL && cap == size + align && c->cap - c->used > cap - n->used) {
        /* a one-off big chunk goes behind the current one so its free tail stays usable */
        n->next = c->next;
        c->next = n;
    } else {
        n->next = c;
        arena->head = n;
    }
    arena->bytes_used += size;
    return n->data + off;
}

void *pd_arena_calloc(pd_arena_t *arena, size_t n, size_t size)
{
    if (size != 0 && n > SIZE_MAX / size) {
        return NULL;
    }
    void *p = pd_arena_alloc(arena, n * size, 16);
    if (p != NULL) {
        memset(p, 0, n * size);
    }
    return p;
}

char *pd_arena_strndup(pd_arena_t *arena, const char *s, size_t n)
{
    size_t len = n == (size_t)-1 ? strlen(s) : n; /* exactly n: s may hold NUL bytes (its length is kept) */
    char *p = pd_arena_alloc(arena, len + 1, 1);
    if (p != NULL) {
        memcpy(p, s, len);
        p[len] = '\0';
    }
    return p;
}

void pd_arena_reset(pd_arena_t *arena)
{
    pd_arena_chunk_t *c = arena->head;
    if (c == NULL) {
        return;
    }
    /* keep the last (oldest) chunk, which has the default size unless everything was big */
    while (c->next != NULL) {
        pd_arena_chunk_t *next = c->next;
        free(c);
        c = next;
    }
    c->used = 0;
    arena->head = c;
    arena->bytes_used = 0;
}

void pd_arena_destroy(pd_arena_t *arena)
{
    pd_arena_chunk_t *c = arena->head;
    while (c != NULL) {
        pd_arena_chunk_t *next = c->next;
        free(c);
        c = next;
    }
    arena->head = NULL;
    arena->bytes_used = 0;
}
