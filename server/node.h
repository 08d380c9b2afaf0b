/* server/node.h — a P/D node: engine + KV connector + HTTP front (pd-prefill, pd-decode). */
#ifndef PD_SERVER_NODE_H
#define PD_SERVER_NODE_H

/* Runs a node of role "prefill" or "decode" with the given command line until SIGTERM;
 * returns the process exit code. */
int pd_node_main(int argc, char **argv, const char *role);

#endif
