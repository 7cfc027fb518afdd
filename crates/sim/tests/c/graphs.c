/* CUDA graphs on the simulated driver, built against CUDA 13.5's cuda.h and linked with -lcuda:
 * every node kind built by hand and launched (bytes copied, memset values, host node order,
 * events, kernel time), per-node parameters, edges, clone, executable updates, enable/disable,
 * user objects, the generic node API, stream capture producing the same graph as the hand-built
 * one, and the error codes cuda.h documents. Prints "OK" and exits 0 when every check holds;
 * otherwise names the failing line. */
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The forms before CUDA 12 that cuda.h 13.5 maps to newer symbols, called by their own names
 * (as programs built with older headers do). */
#undef cuGraphGetEdges
#undef cuGraphExecUpdate
#undef cuGraphKernelNodeGetParams
#undef cuGraphAddDependencies
#undef cuStreamGetCaptureInfo
CUresult cuGraphGetEdges(CUgraph, CUgraphNode *, CUgraphNode *, size_t *);
CUresult cuGraphExecUpdate(CUgraphExec, CUgraph, CUgraphNode *, CUgraphExecUpdateResult *);
CUresult cuGraphKernelNodeGetParams(CUgraphNode, CUDA_KERNEL_NODE_PARAMS_v1 *);
CUresult cuGraphAddDependencies(CUgraph, const CUgraphNode *, const CUgraphNode *, size_t);
CUresult cuStreamGetCaptureInfo(CUstream, CUstreamCaptureStatus *, cuuint64_t *);

static int failures;
#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "graphs.c:%d: check failed: %s\n", __LINE__, #cond);     \
            failures++;                                                              \
        }                                                                            \
    } while (0)
#define OK(call)                                                                     \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                    \
            fprintf(stderr, "graphs.c:%d: %s -> %d\n", __LINE__, #call, (int)r_);    \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
#define IS(call, want)                                                               \
    do {                                                                             \
        CUresult r_ = (call);                                                        \
        if (r_ != (want)) {                                                          \
            fprintf(stderr, "graphs.c:%d: %s -> %d, want %d\n", __LINE__, #call,     \
                    (int)r_, (int)(want));                                           \
            failures++;                                                              \
        }                                                                            \
    } while (0)

/* Host nodes append their tag to this log, in the order they run. */
static int order_log[32];
static int order_n;
static void CUDA_CB log_tag(void *tag) { order_log[order_n++] = (int)(size_t)tag; }

static CUfunction busy, other;
static CUcontext ctx;

static CUDA_MEMCPY3D copy1d(CUmemorytype st, const void *sh, CUdeviceptr sd, CUmemorytype dt,
                            void *dh, CUdeviceptr dd, size_t n) {
    CUDA_MEMCPY3D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = st;
    c.srcHost = sh;
    c.srcDevice = sd;
    c.dstMemoryType = dt;
    c.dstHost = dh;
    c.dstDevice = dd;
    c.WidthInBytes = n;
    c.Height = 1;
    c.Depth = 1;
    return c;
}

static CUDA_KERNEL_NODE_PARAMS kernel_params(CUfunction f, void **args) {
    CUDA_KERNEL_NODE_PARAMS k;
    memset(&k, 0, sizeof k);
    k.func = f;
    k.gridDimX = k.gridDimY = k.gridDimZ = 1;
    k.blockDimX = 32;
    k.blockDimY = k.blockDimZ = 1;
    k.kernelParams = args;
    return k;
}

static CUDA_MEMSET_NODE_PARAMS memset_params(CUdeviceptr dst, size_t pitch, unsigned value,
                                             unsigned elem, size_t width, size_t height) {
    CUDA_MEMSET_NODE_PARAMS m;
    memset(&m, 0, sizeof m);
    m.dst = dst;
    m.pitch = pitch;
    m.value = value;
    m.elementSize = elem;
    m.width = width;
    m.height = height;
    return m;
}

static size_t count_nodes(CUgraph g) {
    size_t n = 0;
    OK(cuGraphGetNodes(g, NULL, &n));
    return n;
}

static size_t count_edges(CUgraph g) {
    size_t n = 0;
    OK(cuGraphGetEdges_v2(g, NULL, NULL, NULL, &n));
    return n;
}

/* The graph's node types in node order, and its edges as index pairs (sorted), so that two
 * graphs can be compared by shape. Returns the node count. */
static size_t shape(CUgraph g, int *types, int (*edges)[2], size_t *nedges) {
    CUgraphNode nodes[32], from[64], to[64];
    size_t n = 32, e = 64;
    OK(cuGraphGetNodes(g, nodes, &n));
    for (size_t i = 0; i < n; i++) {
        CUgraphNodeType t;
        OK(cuGraphNodeGetType(nodes[i], &t));
        types[i] = (int)t;
    }
    OK(cuGraphGetEdges_v2(g, from, to, NULL, &e));
    for (size_t k = 0; k < e; k++) {
        edges[k][0] = edges[k][1] = -1;
        for (size_t i = 0; i < n; i++) {
            if (nodes[i] == from[k]) edges[k][0] = (int)i;
            if (nodes[i] == to[k]) edges[k][1] = (int)i;
        }
    }
    /* sort edges */
    for (size_t a = 0; a < e; a++)
        for (size_t b = a + 1; b < e; b++)
            if (edges[b][0] < edges[a][0] || (edges[b][0] == edges[a][0] && edges[b][1] < edges[a][1])) {
                int t0 = edges[a][0], t1 = edges[a][1];
                edges[a][0] = edges[b][0];
                edges[a][1] = edges[b][1];
                edges[b][0] = t0;
                edges[b][1] = t1;
            }
    *nedges = e;
    return n;
}

/* ---- 1. every node kind by hand, launched ---------------------------------------------------- */
static void every_kind(CUstream s) {
    CUdeviceptr a, b;
    OK(cuMemAlloc(&a, 4096));
    OK(cuMemAlloc(&b, 4096));
    OK(cuMemsetD8(a, 0, 4096));
    OK(cuMemsetD8(b, 0, 4096));
    unsigned char in[1024], out[4096];
    for (int i = 0; i < 1024; i++) in[i] = (unsigned char)(i * 7 + 1);
    memset(out, 0xee, sizeof out);
    CUevent ev, t0, t1;
    OK(cuEventCreate(&ev, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&t0, CU_EVENT_DEFAULT));
    OK(cuEventCreate(&t1, CU_EVENT_DEFAULT));

    CUgraph g;
    OK(cuGraphCreate(&g, 0));
    CUgraphNode n_set, n_h2d, n_2d, n_kern, n_host1, n_rec, n_child, n_empty, n_d2h, n_host3, n_wait;
    /* memset 2D: 4 rows of 16 32-bit words, pitch 256 */
    CUDA_MEMSET_NODE_PARAMS ms = memset_params(a, 256, 0x11223344u, 4, 16, 4);
    OK(cuGraphAddMemsetNode(&n_set, g, NULL, 0, &ms, ctx));
    /* host to device, 1D */
    CUDA_MEMCPY3D c1 = copy1d(CU_MEMORYTYPE_HOST, in, 0, CU_MEMORYTYPE_DEVICE, NULL, b, 1024);
    OK(cuGraphAddMemcpyNode(&n_h2d, g, NULL, 0, &c1, ctx));
    /* device to device, 2D: 64 bytes x 4 rows from a (pitch 256) to b + 2048 (pitch 128) */
    CUDA_MEMCPY3D c2;
    memset(&c2, 0, sizeof c2);
    c2.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c2.srcDevice = a;
    c2.srcPitch = 256;
    c2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    c2.dstDevice = b + 2048;
    c2.dstPitch = 128;
    c2.WidthInBytes = 64;
    c2.Height = 4;
    c2.Depth = 1;
    CUgraphNode deps2[2] = {n_set, n_h2d};
    OK(cuGraphAddMemcpyNode(&n_2d, g, deps2, 2, &c2, ctx));
    /* a kernel of 2 ms */
    unsigned long long ns = 2000000ull;
    void *args[] = {&ns};
    CUDA_KERNEL_NODE_PARAMS kp = kernel_params(busy, args);
    OK(cuGraphAddKernelNode(&n_kern, g, &n_2d, 1, &kp));
    CUDA_HOST_NODE_PARAMS hp = {log_tag, (void *)1};
    OK(cuGraphAddHostNode(&n_host1, g, &n_kern, 1, &hp));
    OK(cuGraphAddEventRecordNode(&n_rec, g, &n_host1, 1, ev));
    /* child: a host node (tag 2), then a memset of 16 bytes at b + 3000 */
    CUgraph child;
    OK(cuGraphCreate(&child, 0));
    CUgraphNode c_host, c_set;
    CUDA_HOST_NODE_PARAMS hp2 = {log_tag, (void *)2};
    OK(cuGraphAddHostNode(&c_host, child, NULL, 0, &hp2));
    CUDA_MEMSET_NODE_PARAMS ms2 = memset_params(b + 3000, 0, 0x5a, 1, 16, 1);
    OK(cuGraphAddMemsetNode(&c_set, child, &c_host, 1, &ms2, ctx));
    OK(cuGraphAddChildGraphNode(&n_child, g, &n_rec, 1, child));
    OK(cuGraphAddEmptyNode(&n_empty, g, &n_child, 1));
    CUDA_MEMCPY3D c3 = copy1d(CU_MEMORYTYPE_DEVICE, NULL, b, CU_MEMORYTYPE_HOST, out, 0, 4096);
    OK(cuGraphAddMemcpyNode(&n_d2h, g, &n_empty, 1, &c3, ctx));
    CUDA_HOST_NODE_PARAMS hp3 = {log_tag, (void *)3};
    OK(cuGraphAddHostNode(&n_host3, g, &n_d2h, 1, &hp3));
    OK(cuGraphAddEventWaitNode(&n_wait, g, NULL, 0, t0));

    /* types, edges, roots */
    CUgraphNodeType t;
    CUgraphNode all[] = {n_set, n_h2d, n_2d, n_kern, n_host1, n_rec, n_child, n_empty, n_d2h, n_host3, n_wait};
    int want_types[] = {CU_GRAPH_NODE_TYPE_MEMSET, CU_GRAPH_NODE_TYPE_MEMCPY, CU_GRAPH_NODE_TYPE_MEMCPY,
                        CU_GRAPH_NODE_TYPE_KERNEL, CU_GRAPH_NODE_TYPE_HOST, CU_GRAPH_NODE_TYPE_EVENT_RECORD,
                        CU_GRAPH_NODE_TYPE_GRAPH, CU_GRAPH_NODE_TYPE_EMPTY, CU_GRAPH_NODE_TYPE_MEMCPY,
                        CU_GRAPH_NODE_TYPE_HOST, CU_GRAPH_NODE_TYPE_WAIT_EVENT};
    for (int i = 0; i < 11; i++) {
        OK(cuGraphNodeGetType(all[i], &t));
        CHECK((int)t == want_types[i]);
    }
    CHECK(count_nodes(g) == 11);
    CHECK(count_edges(g) == 9);
    size_t nroots = 0;
    OK(cuGraphGetRootNodes(g, NULL, &nroots));
    CHECK(nroots == 3); /* memset, h2d, event wait */
    CUgraphNode deps[4];
    size_t nd = 4;
    OK(cuGraphNodeGetDependencies(n_2d, deps, NULL, &nd));
    CHECK(nd == 2 && deps[0] == n_set && deps[1] == n_h2d);
    nd = 4;
    OK(cuGraphNodeGetDependentNodes(n_set, deps, NULL, &nd));
    CHECK(nd == 1 && deps[0] == n_2d);

    /* parameters read back */
    CUDA_MEMSET_NODE_PARAMS ms_back;
    OK(cuGraphMemsetNodeGetParams(n_set, &ms_back));
    CHECK(ms_back.dst == a && ms_back.pitch == 256 && ms_back.value == 0x11223344u && ms_back.elementSize == 4 &&
          ms_back.width == 16 && ms_back.height == 4);
    CUDA_MEMCPY3D c_back;
    OK(cuGraphMemcpyNodeGetParams(n_2d, &c_back));
    CHECK(c_back.srcDevice == a && c_back.dstDevice == b + 2048 && c_back.dstPitch == 128 && c_back.Height == 4);
    CUDA_HOST_NODE_PARAMS hp_back;
    OK(cuGraphHostNodeGetParams(n_host1, &hp_back));
    CHECK(hp_back.fn == log_tag && hp_back.userData == (void *)1);
    CUDA_KERNEL_NODE_PARAMS kp_back;
    OK(cuGraphKernelNodeGetParams_v2(n_kern, &kp_back));
    CHECK(kp_back.func == busy && kp_back.blockDimX == 32 && kp_back.kernelParams != NULL &&
          *(unsigned long long *)kp_back.kernelParams[0] == ns);
    CUDA_KERNEL_NODE_PARAMS_v1 kp1;
    OK(cuGraphKernelNodeGetParams(n_kern, &kp1)); /* v1: the struct without kern and ctx */
    CHECK(kp1.func == busy && *(unsigned long long *)kp1.kernelParams[0] == ns);
    CUgraphNode from1[16], to1[16];
    size_t ne1 = 16;
    OK(cuGraphGetEdges(g, from1, to1, &ne1));
    CHECK(ne1 == 9 && to1[0] == n_2d && (from1[0] == n_set || from1[0] == n_h2d));
    CUevent ev_back;
    OK(cuGraphEventRecordNodeGetEvent(n_rec, &ev_back));
    CHECK(ev_back == ev);
    OK(cuGraphEventWaitNodeGetEvent(n_wait, &ev_back));
    CHECK(ev_back == t0);
    CUgraph owned;
    OK(cuGraphChildGraphNodeGetGraph(n_child, &owned));
    CHECK(owned != child && count_nodes(owned) == 2); /* the node holds a clone */
    /* a Get of the wrong kind */
    IS(cuGraphMemsetNodeGetParams(n_h2d, &ms_back), CUDA_ERROR_INVALID_VALUE);
    /* documented argument errors */
    CUDA_MEMSET_NODE_PARAMS bad = memset_params(a, 256, 0, 3, 16, 1);
    CUgraphNode nb;
    IS(cuGraphAddMemsetNode(&nb, g, NULL, 0, &bad, ctx), CUDA_ERROR_INVALID_VALUE); /* element size 3 */
    bad = memset_params(a, 8, 0, 4, 16, 2);
    IS(cuGraphAddMemsetNode(&nb, g, NULL, 0, &bad, ctx), CUDA_ERROR_INVALID_VALUE); /* pitch < row */
    CUDA_HOST_NODE_PARAMS nohost = {NULL, NULL};
    IS(cuGraphAddHostNode(&nb, g, NULL, 0, &nohost), CUDA_ERROR_INVALID_VALUE);
    IS(cuGraphAddEmptyNode(&nb, g, &n_set, 1), CUDA_SUCCESS);
    OK(cuGraphDestroyNode(nb));
    CHECK(count_nodes(g) == 11);

    /* launch: t0 recorded before, t1 after */
    CUgraphExec x;
    OK(cuGraphInstantiate(&x, g, 0));
    OK(cuEventRecord(t0, s));
    order_n = 0;
    OK(cuGraphLaunch(x, s));
    OK(cuEventRecord(t1, s));
    OK(cuStreamSynchronize(s));
    for (int i = 0; i < 1024; i++) CHECK(out[i] == in[i]);
    for (int r = 0; r < 4; r++)
        for (int w = 0; w < 16; w++) {
            unsigned v;
            memcpy(&v, out + 2048 + r * 128 + w * 4, 4);
            CHECK(v == 0x11223344u);
        }
    CHECK(out[2048 + 64] == 0); /* beyond the copied width */
    for (int i = 3000; i < 3016; i++) CHECK(out[i] == 0x5a);
    CHECK(out[3016] == 0);
    CHECK(order_n == 3 && order_log[0] == 1 && order_log[1] == 2 && order_log[2] == 3);
    OK(cuEventQuery(ev));
    float ms_elapsed = 0;
    OK(cuEventElapsedTime(&ms_elapsed, t0, t1));
    CHECK(ms_elapsed >= 1.9f); /* the kernel node took its 2 ms */

    /* executable node parameters: a new memset value, seen by the next launch */
    CUDA_MEMSET_NODE_PARAMS ms3 = memset_params(a, 256, 0x01020304u, 4, 16, 4);
    OK(cuGraphExecMemsetNodeSetParams(x, n_set, &ms3, ctx));
    CUDA_HOST_NODE_PARAMS hp4 = {log_tag, (void *)4};
    OK(cuGraphExecHostNodeSetParams(x, n_host3, &hp4));
    IS(cuGraphExecHostNodeSetParams(x, n_set, &hp4), CUDA_ERROR_INVALID_VALUE); /* not a host node */
    order_n = 0;
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    unsigned v;
    memcpy(&v, out + 2048, 4);
    CHECK(v == 0x01020304u);
    CHECK(order_n == 3 && order_log[2] == 4);
    /* the graph's own node kept its parameters */
    OK(cuGraphMemsetNodeGetParams(n_set, &ms_back));
    CHECK(ms_back.value == 0x11223344u);

    /* disabled nodes act as empty ones: only kernel, memset and memcpy nodes can be */
    unsigned on = 7;
    OK(cuGraphNodeSetEnabled(x, n_set, 0));
    OK(cuGraphNodeGetEnabled(x, n_set, &on));
    CHECK(on == 0);
    IS(cuGraphNodeSetEnabled(x, n_host1, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemsetD8(a, 0x77, 4096));
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    CHECK(out[2048] == 0x77 && out[2048 + 63] == 0x77);
    OK(cuGraphNodeSetEnabled(x, n_set, 1));

    cuuint64_t flags = 9;
    OK(cuGraphExecGetFlags(x, &flags));
    CHECK(flags == 0);
    CUgraphExec xf;
    OK(cuGraphInstantiate(&xf, g, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH));
    OK(cuGraphExecGetFlags(xf, &flags));
    CHECK(flags == CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    OK(cuGraphExecDestroy(xf));

    /* ---- update ---- */
    CUgraph g2;
    OK(cuGraphClone(&g2, g));
    CUgraphNode host1_in_clone;
    OK(cuGraphNodeFindInClone(&host1_in_clone, n_host1, g2));
    OK(cuGraphNodeGetType(host1_in_clone, &t));
    CHECK(t == CU_GRAPH_NODE_TYPE_HOST && host1_in_clone != n_host1);
    CUgraph unrelated;
    OK(cuGraphCreate(&unrelated, 0));
    IS(cuGraphNodeFindInClone(&host1_in_clone, n_host1, unrelated), CUDA_ERROR_INVALID_VALUE);
    CUDA_HOST_NODE_PARAMS hp5 = {log_tag, (void *)5};
    OK(cuGraphHostNodeSetParams(host1_in_clone, &hp5));
    CUgraphExecUpdateResultInfo info;
    OK(cuGraphExecUpdate_v2(x, g2, &info));
    CHECK(info.result == CU_GRAPH_EXEC_UPDATE_SUCCESS);
    order_n = 0;
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    CHECK(order_n == 3 && order_log[0] == 5 && order_log[2] == 3);
    /* a node of another type at the same place */
    CUgraph g3;
    OK(cuGraphCreate(&g3, 0));
    CUgraphNode e1, e2;
    OK(cuGraphAddEmptyNode(&e1, g3, NULL, 0));
    OK(cuGraphAddEmptyNode(&e2, g3, &e1, 1));
    CUgraph g4;
    OK(cuGraphCreate(&g4, 0));
    CUgraphNode f1, f2;
    OK(cuGraphAddEmptyNode(&f1, g4, NULL, 0));
    OK(cuGraphAddHostNode(&f2, g4, &f1, 1, &hp));
    CUgraphExec x3;
    OK(cuGraphInstantiate(&x3, g3, 0));
    IS(cuGraphExecUpdate_v2(x3, g4, &info), CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE);
    CHECK(info.result == CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED && info.errorNode == f2);
    CUgraphNode err_node = NULL;
    CUgraphExecUpdateResult res = CU_GRAPH_EXEC_UPDATE_SUCCESS;
    IS(cuGraphExecUpdate(x3, g4, &err_node, &res), CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE); /* v1 */
    CHECK(res == CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED && err_node == f2);
    IS(cuGraphExecUpdate_v2(x3, g, &info), CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE);
    CHECK(info.result == CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED && info.errorNode == NULL);
    /* an edge removed: the topology changed */
    CUgraph g5;
    OK(cuGraphClone(&g5, g3));
    CUgraphNode e1c, e2c;
    OK(cuGraphNodeFindInClone(&e1c, e1, g5));
    OK(cuGraphNodeFindInClone(&e2c, e2, g5));
    OK(cuGraphRemoveDependencies(g5, &e1c, &e2c, NULL, 1));
    IS(cuGraphRemoveDependencies(g5, &e1c, &e2c, NULL, 1), CUDA_ERROR_INVALID_VALUE); /* not there */
    IS(cuGraphExecUpdate_v2(x3, g5, &info), CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE);
    CHECK(info.result == CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED && info.errorNode == e2c);
    OK(cuGraphAddDependencies(g5, &e1c, &e2c, 1)); /* v1 */
    IS(cuGraphAddDependencies_v2(g5, &e1c, &e2c, NULL, 1), CUDA_ERROR_INVALID_VALUE); /* exists */
    OK(cuGraphExecUpdate_v2(x3, g5, &info));
    /* a dependency cycle cannot be instantiated */
    OK(cuGraphAddDependencies_v2(g5, &e2c, &e1c, NULL, 1));
    CUgraphExec xc;
    IS(cuGraphInstantiate(&xc, g5, 0), CUDA_ERROR_INVALID_VALUE);
    CUDA_GRAPH_INSTANTIATE_PARAMS ip;
    memset(&ip, 0, sizeof ip);
    IS(cuGraphInstantiateWithParams(&xc, g5, &ip), CUDA_ERROR_INVALID_VALUE);
    CHECK(ip.result_out == CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE && ip.hErrNode_out == e1c);

    /* DOT output */
    char path[64];
    snprintf(path, sizeof path, "/tmp/cuvisor-graph-%d.dot", (int)getpid());
    OK(cuGraphDebugDotPrint(g, path, CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE));
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    if (f) {
        char buf[8192];
        size_t got = fread(buf, 1, sizeof buf - 1, f);
        buf[got] = 0;
        fclose(f);
        CHECK(strstr(buf, "digraph") != NULL && strstr(buf, "->") != NULL && strstr(buf, "MEMSET") != NULL);
        int arrows = 0;
        for (char *p = buf; (p = strstr(p, "->")); p += 2) arrows++;
        CHECK(arrows == 9);
    }
    unlink(path);
    IS(cuGraphDebugDotPrint(g, "/nonexistent-dir/x.dot", 0), CUDA_ERROR_OPERATING_SYSTEM);

    OK(cuGraphExecDestroy(x));
    OK(cuGraphExecDestroy(x3));
    for (CUgraph *p = (CUgraph[]){g, g2, g3, g4, g5, child, unrelated}, *e = p + 7; p < e; p++) OK(cuGraphDestroy(*p));
    IS(cuGraphNodeGetType(n_set, &t), CUDA_ERROR_INVALID_VALUE); /* its graph is gone */
    OK(cuMemFree(a));
    OK(cuMemFree(b));
}

/* ---- 2. memory nodes and the generic node API ------------------------------------------------ */
static void memory_and_generic(CUstream s) {
    CUgraph g;
    OK(cuGraphCreate(&g, 0));
    CUDA_MEM_ALLOC_NODE_PARAMS ap;
    memset(&ap, 0, sizeof ap);
    ap.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    ap.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    ap.poolProps.location.id = 0;
    ap.bytesize = 1 << 20;
    CUgraphNode n_alloc, n_set, n_d2h, n_free;
    OK(cuGraphAddMemAllocNode(&n_alloc, g, NULL, 0, &ap));
    CHECK(ap.dptr != 0);
    /* the generic API: a memset node of 32-bit words */
    CUgraphNodeParams np;
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_MEMSET;
    np.memset.dst = ap.dptr;
    np.memset.value = 0xabcdef01u;
    np.memset.elementSize = 4;
    np.memset.width = 256;
    np.memset.height = 1;
    OK(cuGraphAddNode(&n_set, g, &n_alloc, NULL, 1, &np));
    unsigned out[256];
    memset(out, 0, sizeof out);
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_MEMCPY;
    np.memcpy.copyParams = copy1d(CU_MEMORYTYPE_DEVICE, NULL, ap.dptr, CU_MEMORYTYPE_HOST, out, 0, sizeof out);
    OK(cuGraphAddNode(&n_d2h, g, &n_set, NULL, 1, &np));
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_MEM_FREE;
    np.free.dptr = ap.dptr;
    OK(cuGraphAddNode(&n_free, g, &n_d2h, NULL, 1, &np));
    CUDA_MEMSET_NODE_PARAMS back;
    OK(cuGraphMemsetNodeGetParams(n_set, &back));
    CHECK(back.dst == ap.dptr && back.value == 0xabcdef01u && back.elementSize == 4 && back.width == 256);
    CUgraphNodeType t;
    OK(cuGraphNodeGetType(n_free, &t));
    CHECK(t == CU_GRAPH_NODE_TYPE_MEM_FREE);
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_MEMSET;
    np.reserved0[1] = 1; /* "Reserved. Must be zero." */
    CUgraphNode nb;
    IS(cuGraphAddNode(&nb, g, NULL, NULL, 0, &np), CUDA_ERROR_INVALID_VALUE);

    /* graphs with memory nodes cannot be cloned, nor cloned into a child graph node */
    CUgraph nope, parent;
    IS(cuGraphClone(&nope, g), CUDA_ERROR_INVALID_VALUE);
    OK(cuGraphCreate(&parent, 0));
    IS(cuGraphAddChildGraphNode(&nb, parent, NULL, 0, g), CUDA_ERROR_INVALID_VALUE);
    OK(cuGraphDestroy(parent));
    CUgraphExec x, x2;
    IS(cuGraphInstantiate(&x, g, CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH),
       CUDA_ERROR_INVALID_VALUE); /* "cannot be used in conjunction" */
    OK(cuGraphInstantiate(&x, g, 0));
    /* a graph with memory nodes has at most one executable at a time */
    IS(cuGraphInstantiate(&x2, g, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    for (int i = 0; i < 256; i++) CHECK(out[i] == 0xabcdef01u);
    /* the executable's memset through the generic setter */
    memset(&np, 0, sizeof np);
    np.type = CU_GRAPH_NODE_TYPE_MEMSET;
    np.memset.dst = ap.dptr;
    np.memset.value = 0x600dcafeu;
    np.memset.elementSize = 4;
    np.memset.width = 256;
    np.memset.height = 1;
    OK(cuGraphExecNodeSetParams(x, n_set, &np));
    IS(cuGraphExecNodeSetParams(x, n_d2h, &np), CUDA_ERROR_INVALID_VALUE); /* a memcpy node */
    IS(cuGraphNodeSetParams(n_d2h, &np), CUDA_ERROR_INVALID_VALUE);
    CUgraphNodeParams fp;
    memset(&fp, 0, sizeof fp);
    fp.type = CU_GRAPH_NODE_TYPE_MEM_FREE;
    fp.free.dptr = ap.dptr;
    IS(cuGraphNodeSetParams(n_free, &fp), CUDA_ERROR_NOT_SUPPORTED);
    IS(cuGraphExecNodeSetParams(x, n_free, &fp), CUDA_ERROR_NOT_SUPPORTED);
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    CHECK(out[0] == 0x600dcafeu && out[255] == 0x600dcafeu);
    OK(cuGraphExecDestroy(x));
    OK(cuGraphInstantiate(&x2, g, 0)); /* the first one is gone */
    OK(cuGraphExecDestroy(x2));
    OK(cuGraphDestroy(g));
}

/* ---- 2b. a 3D copy of a sub-box, host -> device -> host ------------------------------------------ */
static void copy_3d(CUstream s) {
    enum { W = 8, H = 4, D = 3 };              /* the box: 8 bytes x 4 rows x 3 slices */
    enum { HP = 32, HH = 8, HD = 5 };          /* host volume: pitch 32, 8 rows, 5 slices */
    enum { DP = 64, DH = 16, DD = 4 };         /* device volume: pitch 64, 16 rows, 4 slices */
    static unsigned char src[HD][HH][HP], back[HD][HH][HP];
    for (int z = 0; z < HD; z++)
        for (int y = 0; y < HH; y++)
            for (int x = 0; x < HP; x++) src[z][y][x] = (unsigned char)(z * 64 + y * 8 + x);
    memset(back, 0, sizeof back);
    CUdeviceptr d;
    OK(cuMemAlloc(&d, DP * DH * DD));
    OK(cuMemsetD8(d, 0, DP * DH * DD));
    CUDA_MEMCPY3D up, down;
    memset(&up, 0, sizeof up);
    up.srcMemoryType = CU_MEMORYTYPE_HOST;
    up.srcHost = src;
    up.srcXInBytes = 3;
    up.srcY = 2;
    up.srcZ = 1;
    up.srcPitch = HP;
    up.srcHeight = HH;
    up.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    up.dstDevice = d;
    up.dstXInBytes = 5;
    up.dstY = 7;
    up.dstZ = 1;
    up.dstPitch = DP;
    up.dstHeight = DH;
    up.WidthInBytes = W;
    up.Height = H;
    up.Depth = D;
    memset(&down, 0, sizeof down);
    down.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    down.srcDevice = d;
    down.srcPitch = DP;
    down.srcHeight = DH;
    down.dstMemoryType = CU_MEMORYTYPE_HOST;
    down.dstHost = back;
    down.dstPitch = HP;
    down.dstHeight = HH;
    down.srcY = 4; /* device rows 4..11 of each slice come back as host rows 0..7 */
    down.WidthInBytes = 16;
    down.Height = HH;
    down.Depth = DD;
    CUgraph g;
    OK(cuGraphCreate(&g, 0));
    CUgraphNode n_up, n_down, nb;
    OK(cuGraphAddMemcpyNode(&n_up, g, NULL, 0, &up, ctx));
    OK(cuGraphAddMemcpyNode(&n_down, g, &n_up, 1, &down, ctx));
    CUDA_MEMCPY3D bad = up;
    bad.srcPitch = 4; /* below the width of a row */
    IS(cuGraphAddMemcpyNode(&nb, g, NULL, 0, &bad, ctx), CUDA_ERROR_INVALID_VALUE);
    bad = up;
    bad.srcMemoryType = (CUmemorytype)9;
    IS(cuGraphAddMemcpyNode(&nb, g, NULL, 0, &bad, ctx), CUDA_ERROR_INVALID_VALUE);
    CUgraphExec x;
    OK(cuGraphInstantiate(&x, g, 0));
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    /* device (x, y, z) = (5 + i, 7 + j, 1 + k) holds src (3 + i, 2 + j, 1 + k); device row y
     * came back as host row y - 4, so back[z][y][x] is device (x, y + 4, z) */
    int bad_bytes = 0, seen = 0;
    for (int z = 0; z < DD; z++)
        for (int y = 0; y < HH; y++)
            for (int x = 0; x < 16; x++) {
                int i = x - 5, j = y + 4 - 7, k = z - 1;
                unsigned char want = 0;
                if (i >= 0 && i < W && j >= 0 && j < H && k >= 0 && k < D) {
                    want = src[1 + k][2 + j][3 + i];
                    seen++;
                }
                if (back[z][y][x] != want) bad_bytes++;
            }
    CHECK(bad_bytes == 0);
    CHECK(seen == W * H * D); /* the whole box came back */
    OK(cuGraphExecDestroy(x));
    OK(cuGraphDestroy(g));
    OK(cuMemFree(d));
}

/* ---- 3. user objects --------------------------------------------------------------------------- */
static volatile int destroyed;
static void CUDA_CB destroy_obj(void *p) { destroyed = (int)(size_t)p; }

static int wait_destroyed(int want) {
    for (int i = 0; i < 200 && destroyed != want; i++) usleep(5000);
    return destroyed == want;
}

static void user_objects(void) {
    CUuserObject o;
    IS(cuUserObjectCreate(&o, (void *)42, destroy_obj, 1, 0), CUDA_ERROR_INVALID_VALUE); /* flags required */
    OK(cuUserObjectCreate(&o, (void *)42, destroy_obj, 1, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
    CUgraph g;
    OK(cuGraphCreate(&g, 0));
    CUgraphNode e;
    OK(cuGraphAddEmptyNode(&e, g, NULL, 0));
    OK(cuGraphRetainUserObject(g, o, 1, CU_GRAPH_USER_OBJECT_MOVE)); /* the caller's reference moves */
    CUgraphExec x;
    OK(cuGraphInstantiate(&x, g, 0));
    OK(cuGraphDestroy(g));
    usleep(20000);
    CHECK(destroyed == 0); /* the executable still holds it */
    OK(cuGraphExecDestroy(x));
    CHECK(wait_destroyed(42));
    /* plain references */
    destroyed = 0;
    OK(cuUserObjectCreate(&o, (void *)7, destroy_obj, 2, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
    OK(cuUserObjectRetain(o, 1));
    OK(cuUserObjectRelease(o, 2));
    usleep(20000);
    CHECK(destroyed == 0);
    OK(cuUserObjectRelease(o, 1));
    CHECK(wait_destroyed(7));
    IS(cuUserObjectRelease(o, 1), CUDA_ERROR_INVALID_HANDLE);
}

/* ---- 4. capture = hand-built --------------------------------------------------------------------- */
static void capture_equals_hand_built(CUstream s1, CUstream s2) {
    CUdeviceptr a, b;
    OK(cuMemAlloc(&a, 1024));
    OK(cuMemAlloc(&b, 1024));
    OK(cuMemsetD8(b, 0, 1024));
    unsigned long long ns = 100000ull;
    void *args[] = {&ns};
    CUevent fork, join;
    OK(cuEventCreate(&fork, CU_EVENT_DISABLE_TIMING));
    OK(cuEventCreate(&join, CU_EVENT_DISABLE_TIMING));

    /* captured: s1: memset, kernel, record(fork); s2: wait(fork), copy a->b, record(join);
     * s1: host, wait(join), kernel. */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUstreamCaptureStatus st;
    OK(cuStreamIsCapturing(s1, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    OK(cuMemsetD32Async(a, 0xfeedf00du, 256, s1));
    OK(cuLaunchKernel(busy, 1, 1, 1, 32, 1, 1, 0, s1, args, NULL));
    cuuint64_t id;
    CUgraph cg;
    const CUgraphNode *cdeps;
    const CUgraphEdgeData *cedges;
    size_t ncd = 9;
    OK(cuStreamGetCaptureInfo_v3(s1, &st, &id, &cg, &cdeps, &cedges, &ncd));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE && ncd == 1 && cg != NULL);
    CUgraphNodeType t;
    OK(cuGraphNodeGetType(cdeps[0], &t));
    CHECK(t == CU_GRAPH_NODE_TYPE_KERNEL);
    OK(cuEventRecord(fork, s1));
    IS(cuEventQuery(fork), CUDA_ERROR_CAPTURED_EVENT);
    OK(cuStreamWaitEvent(s2, fork, 0));
    OK(cuStreamIsCapturing(s2, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE); /* s2 joined the capture */
    cuuint64_t id2;
    OK(cuStreamGetCaptureInfo(s2, &st, &id2));
    CHECK(id2 == id);
    OK(cuMemcpyDtoDAsync(b, a, 1024, s2));
    OK(cuEventRecord(join, s2));
    OK(cuLaunchHostFunc(s1, log_tag, (void *)9));
    IS(cuStreamEndCapture(s2, &cg), CUDA_ERROR_STREAM_CAPTURE_UNMATCHED); /* not where it began */
    OK(cuStreamWaitEvent(s1, join, 0));
    OK(cuLaunchKernel(busy, 1, 1, 1, 32, 1, 1, 0, s1, args, NULL));
    CUgraph captured;
    OK(cuStreamEndCapture(s1, &captured));
    OK(cuStreamIsCapturing(s2, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);

    /* by hand, in the same order */
    CUgraph h;
    OK(cuGraphCreate(&h, 0));
    CUgraphNode m, k1, c, ho, k2;
    CUDA_MEMSET_NODE_PARAMS ms = memset_params(a, 0, 0xfeedf00du, 4, 256, 1);
    OK(cuGraphAddMemsetNode(&m, h, NULL, 0, &ms, ctx));
    CUDA_KERNEL_NODE_PARAMS kp = kernel_params(busy, args);
    OK(cuGraphAddKernelNode(&k1, h, &m, 1, &kp));
    CUDA_MEMCPY3D cp = copy1d(CU_MEMORYTYPE_DEVICE, NULL, a, CU_MEMORYTYPE_DEVICE, NULL, b, 1024);
    OK(cuGraphAddMemcpyNode(&c, h, &k1, 1, &cp, ctx));
    CUDA_HOST_NODE_PARAMS hp = {log_tag, (void *)9};
    OK(cuGraphAddHostNode(&ho, h, &k1, 1, &hp));
    CUgraphNode both[2] = {ho, c};
    OK(cuGraphAddKernelNode(&k2, h, both, 2, &kp));

    int ta[32], tb[32], ea[64][2], eb[64][2];
    size_t nea, neb;
    size_t na = shape(captured, ta, ea, &nea), nb = shape(h, tb, eb, &neb);
    CHECK(na == 5 && nb == 5 && nea == 5 && neb == 5);
    for (size_t i = 0; i < na && i < nb; i++) CHECK(ta[i] == tb[i]);
    for (size_t i = 0; i < nea && i < neb; i++) CHECK(ea[i][0] == eb[i][0] && ea[i][1] == eb[i][1]);

    /* the captured graph runs */
    CUgraphExec x;
    OK(cuGraphInstantiate(&x, captured, 0));
    order_n = 0;
    OK(cuGraphLaunch(x, s1));
    OK(cuStreamSynchronize(s1));
    unsigned out[256];
    OK(cuMemcpyDtoH(out, b, sizeof out));
    CHECK(out[0] == 0xfeedf00du && out[255] == 0xfeedf00du);
    CHECK(order_n == 1 && order_log[0] == 9);

    /* a graph launched into a capture becomes a child graph node */
    CUgraph outer;
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuGraphLaunch(x, s1));
    OK(cuStreamEndCapture(s1, &outer));
    CUgraphNode only;
    size_t one = 1;
    OK(cuGraphGetNodes(outer, &only, &one));
    OK(cuGraphNodeGetType(only, &t));
    CHECK(one == 1 && t == CU_GRAPH_NODE_TYPE_GRAPH);

    /* capture into an existing graph, after a given node, and dependency updates */
    CUgraph into;
    OK(cuGraphCreate(&into, 0));
    CUgraphNode root, extra;
    OK(cuGraphAddEmptyNode(&root, into, NULL, 0));
    OK(cuGraphAddEmptyNode(&extra, into, NULL, 0));
    OK(cuStreamBeginCaptureToGraph(s1, into, &root, NULL, 1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuMemsetD8Async(b, 1, 16, s1));
    OK(cuStreamUpdateCaptureDependencies(s1, &extra, NULL, 1, CU_STREAM_ADD_CAPTURE_DEPENDENCIES));
    OK(cuMemsetD8Async(b, 2, 16, s1));
    CUgraph same;
    OK(cuStreamEndCapture(s1, &same));
    CHECK(same == into && count_nodes(into) == 4 && count_edges(into) == 3);
    IS(cuStreamUpdateCaptureDependencies(s1, &extra, NULL, 1, 0), CUDA_ERROR_ILLEGAL_STATE);

    OK(cuGraphExecDestroy(x));
    for (CUgraph *p = (CUgraph[]){captured, h, outer, into}, *e = p + 4; p < e; p++) OK(cuGraphDestroy(*p));
    OK(cuMemFree(a));
    OK(cuMemFree(b));
}

/* ---- 5. capture rules and their errors ----------------------------------------------------------- */
static CUstream thread_stream;
static CUresult thread_result;
static void *end_elsewhere(void *arg) {
    (void)arg;
    cuCtxSetCurrent(ctx);
    CUgraph g;
    thread_result = cuStreamEndCapture(thread_stream, &g);
    return NULL;
}

static void capture_errors(CUstream s1, CUstream s2) {
    CUgraph g = (CUgraph)1;
    CUdeviceptr p;
    /* synchronizing a capturing stream is refused and invalidates the capture */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    IS(cuStreamSynchronize(s1), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CUstreamCaptureStatus st;
    OK(cuStreamIsCapturing(s1, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    IS(cuMemsetD8Async(0x1000, 0, 16, s1), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(g == NULL);

    /* synchronizing the context waits for the capturing stream: refused, capture invalidated */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_RELAXED));
    IS(cuCtxSynchronize(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    OK(cuCtxSynchronize());

    /* global mode: cuMemAlloc is a potentially unsafe call; a relaxed thread may make it */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    OK(cuThreadExchangeStreamCaptureMode(&mode));
    CHECK(mode == CU_STREAM_CAPTURE_MODE_GLOBAL);
    IS(cuMemAlloc(&p, 256), CUDA_SUCCESS);
    OK(cuMemFree(p));
    OK(cuThreadExchangeStreamCaptureMode(&mode)); /* back to global */
    IS(cuMemAlloc(&p, 256), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* a relaxed capture prohibits nothing */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_RELAXED));
    OK(cuMemAlloc(&p, 256));
    OK(cuMemFree(p));
    OK(cuStreamEndCapture(s1, &g));
    OK(cuGraphDestroy(g));

    /* a fork that never joins */
    CUevent e;
    OK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuLaunchHostFunc(s1, log_tag, (void *)1));
    OK(cuEventRecord(e, s1));
    OK(cuStreamWaitEvent(s2, e, 0));
    OK(cuLaunchHostFunc(s2, log_tag, (void *)2));
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
    OK(cuStreamIsCapturing(s2, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);

    /* ended on another thread than the one that began it */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    thread_stream = s1;
    pthread_t th;
    pthread_create(&th, NULL, end_elsewhere, NULL);
    pthread_join(th, NULL);
    CHECK(thread_result == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
    OK(cuStreamEndCapture(s1, &g));
    OK(cuGraphDestroy(g));
    /* ... which a relaxed capture allows */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_RELAXED));
    pthread_create(&th, NULL, end_elsewhere, NULL);
    pthread_join(th, NULL);
    CHECK(thread_result == CUDA_SUCCESS);

    /* the legacy stream cannot capture; nested begin is an illegal state */
    IS(cuStreamBeginCapture(CU_STREAM_LEGACY, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    IS(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_ILLEGAL_STATE);
    /* an event from outside the capture, waited on without CU_EVENT_WAIT_EXTERNAL */
    CUevent outside;
    OK(cuEventCreate(&outside, 0));
    OK(cuEventRecord(outside, s2));
    IS(cuStreamWaitEvent(s1, outside, 0), CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* ... with it, an event wait node; CU_EVENT_RECORD_EXTERNAL, an event record node */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuStreamWaitEvent(s1, outside, CU_EVENT_WAIT_EXTERNAL));
    OK(cuEventRecordWithFlags(outside, s1, CU_EVENT_RECORD_EXTERNAL));
    OK(cuStreamEndCapture(s1, &g));
    CUgraphNode nodes[4];
    size_t n = 4;
    OK(cuGraphGetNodes(g, nodes, &n));
    CUgraphNodeType t0, t1;
    CHECK(n == 2);
    OK(cuGraphNodeGetType(nodes[0], &t0));
    OK(cuGraphNodeGetType(nodes[1], &t1));
    CHECK(t0 == CU_GRAPH_NODE_TYPE_WAIT_EVENT && t1 == CU_GRAPH_NODE_TYPE_EVENT_RECORD);
    OK(cuGraphDestroy(g));
    /* outside capture the external wait flag is invalid */
    IS(cuStreamWaitEvent(s1, outside, CU_EVENT_WAIT_EXTERNAL), CUDA_ERROR_INVALID_VALUE);
    /* no capture to end */
    IS(cuStreamEndCapture(s1, &g), CUDA_ERROR_ILLEGAL_STATE);

    /* a blocking stream capturing makes the legacy stream unusable */
    CUstream blocking;
    OK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
    OK(cuStreamBeginCapture(blocking, CU_STREAM_CAPTURE_MODE_GLOBAL));
    IS(cuStreamIsCapturing(CU_STREAM_LEGACY, &st), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    OK(cuStreamIsCapturing(blocking, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE); /* a query does not invalidate */
    OK(cuLaunchHostFunc(s1, log_tag, (void *)1)); /* a non-blocking stream is not affected */
    IS(cuLaunchHostFunc(CU_STREAM_LEGACY, log_tag, (void *)1), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    IS(cuStreamEndCapture(blocking, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    OK(cuStreamSynchronize(s1));
    /* a non-blocking capture leaves it alone */
    OK(cuStreamBeginCapture(s1, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuStreamIsCapturing(CU_STREAM_LEGACY, &st));
    CHECK(st == CU_STREAM_CAPTURE_STATUS_NONE);
    OK(cuStreamEndCapture(s1, &g));
    OK(cuGraphDestroy(g));
    OK(cuStreamDestroy(blocking));
}

/* 2D copies and memsets captured become memcpy and memset nodes that move nothing until the graph
 * runs; a peer copy, which the simulated graphs have no node for, is refused and invalidates the
 * capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, then ..._INVALIDATED at its end). */
static void capture_2d(CUstream s) {
    enum { W = 64, H = 4 };
    unsigned char host[H][W], back[H][W];
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) host[y][x] = (unsigned char)(y * W + x);
    CUdeviceptr img, fill;
    size_t pitch, fpitch;
    OK(cuMemAllocPitch(&img, &pitch, W, H, 4));
    OK(cuMemAllocPitch(&fill, &fpitch, 8 * 4, H, 4));
    OK(cuMemsetD2D8(img, pitch, 0, W, H));
    OK(cuMemsetD2D32(fill, fpitch, 0, 8, H));
    CUDA_MEMCPY2D up;
    memset(&up, 0, sizeof up);
    up.srcMemoryType = CU_MEMORYTYPE_HOST;
    up.srcHost = host;
    up.srcPitch = W;
    up.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    up.dstDevice = img;
    up.dstPitch = pitch;
    up.WidthInBytes = W;
    up.Height = H;

    CUgraph g;
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuMemcpy2DAsync(&up, s));
    IS(cuMemcpyPeerAsync(fill, ctx, img, ctx, 16, s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    IS(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuMemcpy2DAsync(&up, s));
    OK(cuMemsetD2D32Async(fill, fpitch, 0xabcd1234u, 8, H, s));
    OK(cuStreamEndCapture(s, &g));
    CUgraphNode nodes[4];
    size_t n = 4;
    OK(cuGraphGetNodes(g, nodes, &n));
    CHECK(n == 2);
    CUgraphNodeType t0 = CU_GRAPH_NODE_TYPE_EMPTY, t1 = CU_GRAPH_NODE_TYPE_EMPTY;
    if (n == 2) {
        OK(cuGraphNodeGetType(nodes[0], &t0));
        OK(cuGraphNodeGetType(nodes[1], &t1));
    }
    CHECK(t0 == CU_GRAPH_NODE_TYPE_MEMCPY && t1 == CU_GRAPH_NODE_TYPE_MEMSET);

    /* Captured, not run: the device memory is as it was. */
    CUDA_MEMCPY2D down = up;
    down.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    down.srcDevice = img;
    down.srcHost = NULL;
    down.srcPitch = pitch;
    down.dstMemoryType = CU_MEMORYTYPE_HOST;
    down.dstHost = back;
    down.dstDevice = 0;
    down.dstPitch = W;
    OK(cuMemcpy2D(&down));
    int zero = 1;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) zero &= back[y][x] == 0;
    CHECK(zero);

    CUgraphExec x;
    OK(cuGraphInstantiate(&x, g, 0));
    OK(cuGraphLaunch(x, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemcpy2D(&down));
    CHECK(memcmp(back, host, sizeof host) == 0);
    unsigned int words[H][8];
    CUDA_MEMCPY2D fdown;
    memset(&fdown, 0, sizeof fdown);
    fdown.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    fdown.srcDevice = fill;
    fdown.srcPitch = fpitch;
    fdown.dstMemoryType = CU_MEMORYTYPE_HOST;
    fdown.dstHost = words;
    fdown.dstPitch = sizeof words[0];
    fdown.WidthInBytes = sizeof words[0];
    fdown.Height = H;
    OK(cuMemcpy2D(&fdown));
    int filled = 1;
    for (int y = 0; y < H; y++)
        for (int i = 0; i < 8; i++) filled &= words[y][i] == 0xabcd1234u;
    CHECK(filled);
    OK(cuGraphExecDestroy(x));
    OK(cuGraphDestroy(g));
    OK(cuMemFree(img));
    OK(cuMemFree(fill));
}

int main(void) {
    CUdevice dev;
    OK(cuInit(0));
    OK(cuDeviceGet(&dev, 0));
    OK(cuCtxCreate(&ctx, NULL, 0, dev));
    CUmodule mod;
    OK(cuModuleLoadData(&mod, "sim"));
    OK(cuModuleGetFunction(&busy, mod, "sim_busy_kernel"));
    OK(cuModuleGetFunction(&other, mod, "other_kernel"));
    CUstream s1, s2;
    OK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    OK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    every_kind(s1);
    memory_and_generic(s1);
    copy_3d(s1);
    user_objects();
    capture_equals_hand_built(s1, s2);
    capture_errors(s1, s2);
    capture_2d(s1);
    if (failures) {
        printf("FAILED %d\n", failures);
        return 1;
    }
    printf("OK\n");
    return 0;
}
