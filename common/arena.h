/* common/arena.h — bump allocator over chained chunks; everything is freed at once. */
#ifndef PD_COMMON_ARENA_H
#define PD_COMMON_ARENA_H

#include <stddef.h>

typedef struct pd_arena_chunk pd_arena_chunk_t;

typedef struct pd_arena {
    pd_arena_chunk_t *head; /* newest chunk first */
    size_t chunk_size;      /* default bytes per chunk; bigger requests get their own chunk */
    size_t bytes_used;      /* sum of allocation sizes (after alignment) */
} pd_arena_t;

/* Initialises an empty arena; chunk_size 0 means 64 KiB. Allocates nothing yet. */
void pd_arena_init(pd_arena_t *arena, size_t chunk_size);

/* Returns size bytes aligned to align (a power of two <= 4096), or NULL when memory runs out.
 * The memory lives until pd_arena_reset or pd_arena_destroy. */
void *pd_arena_alloc(pd_arena_t *arena, size_t size, size_t align);

/* Like pd_arena_alloc, zero-filled. */
void *pd_arena_calloc(pd_arena_t *arena, size_t n, size_t size);

/* Copies a NUL-terminated string (n == (size_t)-1), or exactly the n bytes at s (NUL bytes included:
 * s must hold n bytes), into the arena and NUL-terminates the copy. */
char *pd_arena_strndup(pd_arena_t *arena, const char *s, size_t n);

/* Frees every allocation but keeps the first chunk for reuse. */
void pd_arena_reset(pd_arena_t *arena);

/* Frees every chunk; the arena may be initialised again. */
void pd_arena_destroy(pd_arena_t *arena);

#endif
