/* common/version.h — pdserve's version, reported by GET /version on every node and the proxy. */
#ifndef PD_COMMON_VERSION_H
#define PD_COMMON_VERSION_H

#define PD_VERSION "0.5.0"

#endif
