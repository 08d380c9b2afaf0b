/* common/status.c — names of status codes. */
#include "common/status.h"

const char *pd_status_str(pd_status_t st)
{
    switch (st) {
    case PD_OK: return "PD_OK";
    case PD_ERR_INVALID_ARG: return "PD_ERR_INVALID_ARG";
    case PD_ERR_NO_MEMORY: return "PD_ERR_NO_MEMORY";
    case PD_ERR_NO_SPACE: return "PD_ERR_NO_SPACE";
    case PD_ERR_IO: return "PD_ERR_IO";
    case PD_ERR_PARSE: return "PD_ERR_PARSE";
    case PD_ERR_OUT_OF_RANGE: return "PD_ERR_OUT_OF_RANGE";
    case PD_ERR_NOT_FOUND: return "PD_ERR_NOT_FOUND";
    case PD_ERR_UNSUPPORTED: return "PD_ERR_UNSUPPORTED";
    case PD_ERR_TIMEOUT: return "PD_ERR_TIMEOUT";
    case PD_ERR_PEER_GONE: return "PD_ERR_PEER_GONE";
    case PD_ERR_REJECTED: return "PD_ERR_REJECTED";
    case PD_ERR_CANCELLED: return "PD_ERR_CANCELLED";
    case PD_ERR_STALE: return "PD_ERR_STALE";
    case PD_ERR_INTERNAL: return "PD_ERR_INTERNAL";
    case PD_ERR_BACKEND: return "PD_ERR_BACKEND";
    }
    return "PD_ERR_UNKNOWN";
}
