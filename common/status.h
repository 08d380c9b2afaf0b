/* common/status.h — status codes returned by every fallible pdserve function. */
#ifndef PD_COMMON_STATUS_H
#define PD_COMMON_STATUS_H

typedef enum pd_status {
    PD_OK = 0,
    PD_ERR_INVALID_ARG = -1,  /* caller passed a bad value (flag, shape, parameter) */
    PD_ERR_NO_MEMORY = -2,    /* an allocation failed */
    PD_ERR_NO_SPACE = -3,     /* a bounded resource (blocks, queue, buffer) is full */
    PD_ERR_IO = -4,           /* open/read/write/mmap failed; errno was logged */
    PD_ERR_PARSE = -5,        /* malformed input file or message (JSON, safetensors, frame) */
    PD_ERR_OUT_OF_RANGE = -6, /* an index (block id, slot, token id, offset) outside its bounds */
    PD_ERR_NOT_FOUND = -7,    /* a named thing (tensor, file, key) does not exist */
    PD_ERR_UNSUPPORTED = -8,  /* valid input this build or backend cannot handle */
    PD_ERR_TIMEOUT = -9,      /* a bounded wait expired */
    PD_ERR_PEER_GONE = -10,   /* the remote side of a connection died or closed */
    PD_ERR_REJECTED = -11,    /* a peer refused (handshake, token, fingerprint) */
    PD_ERR_CANCELLED = -12,   /* the operation was aborted before it completed */
    PD_ERR_STALE = -13,       /* the resource's lease or version expired */
    PD_ERR_INTERNAL = -14,    /* an invariant broke: a bug in pdserve */
    PD_ERR_BACKEND = -15,     /* the compute backend (CUDA, BLAS) reported an error */
} pd_status_t;

/* Returns a static, human-readable name for st ("PD_ERR_TIMEOUT"); never NULL. */
const char *pd_status_str(pd_status_t st);

/* Returns expr's status from the calling function unless it is PD_OK (the error was logged where it
 * was found). The one such macro: code with something to undo uses `goto err_*` instead. */
#define PD_TRY(expr)                                                                                         \
    do {                                                                                                     \
        pd_status_t st_ = (expr);                                                                            \
        if (st_ != PD_OK) {                                                                                  \
            return st_;                                                                                      \
        }                                                                                                    \
    } while (0)

#endif
