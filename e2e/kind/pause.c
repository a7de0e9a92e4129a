/* The pod sandbox's process for the locally built kind node image (e2e/kind/build-node.sh):
 * holds the pod's namespaces, reaps orphaned children, exits on SIGINT/SIGTERM. Built static
 * with the host's C compiler, since registry.k8s.io/pause cannot be pulled here. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) { (void)signo; _exit(0); }

static void on_child(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {}
}

int main(void) {
  struct sigaction stop = {.sa_handler = on_stop}, child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0)
    return 1;
  for (;;) pause();
}
