/* A library linked with -lcuda, for dlopen(RTLD_DEEPBIND): with deep binding its cuMemAlloc_v2
 * reference binds to libcuda's own definition ahead of the preloaded wrapper. */
#ifdef PLAIN
/* Built without -lcuda: deep binding prefers this deep_tag to the program's. */
int deep_tag(void) { return 1; }
int deep_probe(void) { return deep_tag(); }
#else
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*Alloc)(CUdeviceptr *, unsigned long);
CUresult cuMemAlloc_v2(CUdeviceptr *, unsigned long);

/* The function this library's calls to cuMemAlloc_v2 reach (its GOT entry). */
Alloc deep_which(void) { return cuMemAlloc_v2; }
CUresult deep_alloc(CUdeviceptr *p, unsigned long n) { return cuMemAlloc_v2(p, n); }
#endif
