/* prefill/pd-prefill.c — a prefill node: computes prompts (max_tokens 1 from the proxy) and
 * hands their KV to decode nodes (pull: holds it under a lease; push: writes it into their
 * reservations). See server/node.c. */
#include "server/node.h"

int main(int argc, char **argv)
{
    return pd_node_main(argc, argv, "prefill");
}
