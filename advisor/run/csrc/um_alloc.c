/* CUDA managed (Unified) memory for PyTorch: the malloc/free pair that
 * torch.cuda.memory.CUDAPluggableAllocator loads (advisor/run/unified_memory.py builds this file).
 *
 * Each segment the caching allocator asks for is cudaMallocManaged memory, advised to live on the GPU
 * (cudaMemAdviseSetPreferredLocation), mapped for it (SetAccessedBy) and prefetched there, so pages
 * migrate only when the GPU runs short. A cap refuses any allocation that would take the managed
 * bytes in use past it: on a PCIe GPU the cap is the memory the GPU had free, since oversubscribing
 * managed memory over PCIe thrashes and can hang the GPU for every process on it.
 *
 * Built with -DUM_STUB the CUDA calls become malloc/free, so the CPU tests run the cap and counters.
 */
#include <pthread.h>
#include <stddef.h>
#include <sys/types.h>

#ifdef UM_STUB
#include <stdlib.h>
typedef void *cudaStream_t;
static int cudaMallocManaged(void **p, size_t n, unsigned int flags) {
    (void)flags;
    *p = malloc(n);
    return *p ? 0 : 2;
}
static int cudaFree(void *p) {
    free(p);
    return 0;
}
static int um_hint(void *p, size_t n, int device, cudaStream_t s) {
    (void)p, (void)n, (void)device, (void)s;
    return 0;
}
static int um_attr(int device) {
    (void)device;
    return 0;
}
#else
#include <cuda_runtime_api.h>
static int um_hint(void *p, size_t n, int device, cudaStream_t s) {
#if CUDART_VERSION >= 13000
    struct cudaMemLocation loc = {cudaMemLocationTypeDevice, device};
    cudaMemAdvise(p, n, cudaMemAdviseSetPreferredLocation, loc);
    cudaMemAdvise(p, n, cudaMemAdviseSetAccessedBy, loc);
    return (int)cudaMemPrefetchAsync(p, n, loc, 0, s);
#else
    cudaMemAdvise(p, n, cudaMemAdviseSetPreferredLocation, device);
    cudaMemAdvise(p, n, cudaMemAdviseSetAccessedBy, device);
    return (int)cudaMemPrefetchAsync(p, n, device, s);
#endif
}
/* 1 where the GPU reads pageable host memory through the host's page tables (ATS: GH200, GB200 over
 * NVLink-C2C): managed memory may then exceed GPU memory without thrashing a PCIe link. */
static int um_attr(int device) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrPageableMemoryAccessUsesHostPageTables, device) != cudaSuccess) return -1;
    return v;
}
#endif

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t cap_bytes = 0, in_use = 0, peak = 0;
static unsigned long long n_allocs = 0, n_refused = 0;
static int use_hints = 1;

void *um_malloc(ssize_t size, int device, cudaStream_t stream) {
    void *p = NULL;
    size_t n = (size_t)size;
    pthread_mutex_lock(&lock);
    if (cap_bytes && in_use + n > cap_bytes) {
        n_refused++;
        pthread_mutex_unlock(&lock);
        return NULL; /* PyTorch raises OutOfMemoryError; nothing was oversubscribed */
    }
    in_use += n;
    pthread_mutex_unlock(&lock);
    if (cudaMallocManaged(&p, n, 1 /* cudaMemAttachGlobal */) != 0 || p == NULL) {
        pthread_mutex_lock(&lock);
        in_use -= n;
        pthread_mutex_unlock(&lock);
        return NULL;
    }
    if (use_hints) um_hint(p, n, device, stream);
    pthread_mutex_lock(&lock);
    if (in_use > peak) peak = in_use;
    n_allocs++;
    pthread_mutex_unlock(&lock);
    return p;
}

void um_free(void *p, ssize_t size, int device, cudaStream_t stream) {
    (void)device, (void)stream;
    cudaFree(p);
    pthread_mutex_lock(&lock);
    in_use -= (size_t)size;
    pthread_mutex_unlock(&lock);
}

void um_configure(size_t cap, int hints) {
    pthread_mutex_lock(&lock);
    cap_bytes = cap;
    use_hints = hints;
    pthread_mutex_unlock(&lock);
}

size_t um_in_use(void) { return in_use; }
size_t um_peak(void) { return peak; }
unsigned long long um_allocs(void) { return n_allocs; }
unsigned long long um_refused(void) { return n_refused; }
int um_coherent(int device) { return um_attr(device); }
