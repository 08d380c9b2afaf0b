/* proxy/pd-proxy.c — pd-proxy: the OpenAI front of a prefill pool and a decode pool.
 *   pd-proxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 */
#include "common/log.h"
#include "proxy/proxy.h"

int main(int argc, char **argv)
{
    pd_proxy_config_t cfg;
    pd_proxy_config_defaults(&cfg);
    pd_flag_t flags[48];
    size_t n = pd_proxy_flags(&cfg, flags, 48);
    if (n > 48) {
        pd_log_error("pd-proxy: %zu flags, room for 48 (proxy/pd-proxy.c)", n);
        return 2;
    }
    int first = 0;
    pd_status_t st = pd_flags_parse(flags, n, argc, argv,
                                    "usage: pd-proxy --prefill URL[,URL...] --decode URL[,URL...] [options]\n"
                                    "Routes OpenAI completions through a prefill node and a decode node.",
                                    &first);
    if (st == PD_ERR_CANCELLED) {
        return 0;
    }
    if (st != PD_OK || first < argc) {
        return 2;
    }
    st = pd_proxy_run(&cfg);
    pd_log_info("pd-proxy exiting (%s)", pd_status_str(st));
    return st == PD_OK ? 0 : 1;
}
