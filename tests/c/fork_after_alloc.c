/* Allocates 512 MiB (two 256 MiB chunks) under the quota, then makes a child by MODE:
 *   fork-exit:  fork(), the child calls exit(0) (atexit handlers run in the child)
 *   fork-_exit: fork(), the child calls _exit(0)
 *   vfork-exit: vfork(), the child calls exit(0) (in the parent's memory: undefined by POSIX,
 *               done by real programs; atexit handlers run on the parent's data)
 *   fork-exec:  fork(), the child execs /bin/true (under the same LD_PRELOAD)
 * After the child is gone the parent prints "free BYTES" (cuMemGetInfo) before and after, frees
 * one chunk ("after-free BYTES"), allocates until refused ("refill BYTES"), frees everything.
 * After a vfork child's exit() the main thread's thread-local storage is destroyed (the child
 * ran the destructors in the shared memory), which breaks the simulated driver on that thread:
 * the parent carries on on a new thread. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(void **, int);
CUresult cuCtxSetCurrent(void *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)
#define OK(call) do { CUresult r_ = (call); CHECK(r_ == 0, "%s returned %d", #call, r_); } while (0)

static size_t free_now(void) {
    size_t f, t;
    OK(cuMemGetInfo_v2(&f, &t));
    return f;
}

struct job {
    void *ctx;
    CUdeviceptr a, b;
};

static void *after(void *arg) {
    struct job *j = arg;
    OK(cuCtxSetCurrent(j->ctx));
    printf("free %zu\n", free_now());
    OK(cuMemFree_v2(j->a));
    printf("after-free %zu\n", free_now());
    CUdeviceptr p[8];
    int n = 0;
    while (n < 8 && cuMemAlloc_v2(&p[n], 256 << 20) == 0) n++;
    printf("refill %llu\n", (unsigned long long)n << 28);
    while (n > 0) OK(cuMemFree_v2(p[--n]));
    OK(cuMemFree_v2(j->b));
    printf("end %zu\n", free_now());
    return NULL;
}

int main(int argc, char **argv) {
    CHECK(argc == 2, "usage: fork_after_alloc MODE");
    const char *mode = argv[1];
    void *ctx;
    OK(cuInit(0));
    OK(cuDevicePrimaryCtxRetain(&ctx, 0));
    OK(cuCtxSetCurrent(ctx));
    CUdeviceptr a, b;
    OK(cuMemAlloc_v2(&a, 256 << 20));
    OK(cuMemAlloc_v2(&b, 256 << 20));
    printf("before %zu\n", free_now());
    fflush(stdout);
    pid_t pid;
    if (strcmp(mode, "vfork-exit") == 0) {
        pid = vfork();
        if (pid == 0) exit(0);
    } else {
        pid = fork();
        if (pid == 0) {
            if (strcmp(mode, "fork-exit") == 0) exit(0);
            if (strcmp(mode, "fork-_exit") == 0) _exit(0);
            execl("/bin/true", "true", (char *)NULL);
            _exit(127);
        }
    }
    CHECK(pid > 0, "fork");
    int status;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "child status %d", status);
    struct job j = {ctx, a, b};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, after, &j) == 0, "pthread_create");
    CHECK(pthread_join(t, NULL) == 0, "pthread_join");
    return 0;
}
