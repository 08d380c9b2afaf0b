/* decode/pd-decode.c — a decode node: loads a request's prompt KV from the prefill named in its
 * kv_transfer_params (WAITING_FOR_REMOTE_KV), then generates. See server/node.c. */
#include "server/node.h"

int main(int argc, char **argv)
{
    return pd_node_main(argc, argv, "decode");
}
