// Samples one thread's native stack: a helper thread sends it SIGPROF every `period_us`, the
// handler records backtrace()'s return addresses; `stack_sampler_stop` writes one line per sample,
// each frame as "library offset" (offset from the library's load base, for nm/addr2line).
// Built and loaded by benchmarks/profile_step.py --stacks (cc -O2 -shared -fPIC).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { kDepth = 64, kSamples = 20000 };
static void* frames[kSamples][kDepth];
static int depth[kSamples];
static volatile int count, running;
static pid_t target;

static void on_signal(int sig) {
  (void)sig;
  int i = count;
  if (i >= kSamples) return;
  depth[i] = backtrace(frames[i], kDepth);
  count = i + 1;
}

static void* tick(void* arg) {
  long period = (long)arg;
  while (running && count < kSamples) {
    syscall(SYS_tgkill, getpid(), target, SIGPROF);
    usleep(period);
  }
  return NULL;
}

int stack_sampler_start(int tid, long period_us) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  if (sigaction(SIGPROF, &sa, NULL)) return -1;
  void* warm[2];
  backtrace(warm, 2);  // loads the unwinder outside the handler
  target = tid;
  count = 0;
  running = 1;
  pthread_t t;
  if (pthread_create(&t, NULL, tick, (void*)period_us)) return -1;
  pthread_detach(t);
  return 0;
}

int stack_sampler_stop(const char* path) {
  running = 0;
  usleep(20000);
  signal(SIGPROF, SIG_IGN);
  FILE* f = fopen(path, "w");
  if (!f) return -1;
  for (int i = 0; i < count; ++i) {
    for (int d = 2; d < depth[i]; ++d) {  // frames 0 and 1: the handler and the signal trampoline
      Dl_info info;
      if (dladdr(frames[i][d], &info) && info.dli_fname)
        fprintf(f, "%s %lx;", info.dli_fname, (unsigned long)((char*)frames[i][d] - (char*)info.dli_fbase));
      else
        fprintf(f, "? %lx;", (unsigned long)frames[i][d]);
    }
    fputc('\n', f);
  }
  fclose(f);
  return count;
}
