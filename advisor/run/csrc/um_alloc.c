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
/* No CUDA headers: pip's nvidia-cuda-runtime wheels (the runtime torch loads) ship cuda_runtime_api.h
 * without the crt/ headers it includes, so a build against them fails. The few entry points are
 * declared here instead, with the ABI of the libcudart major the build links (UM_CUDART_MAJOR, from its
 * soname). From CUDA 13 on cudaMemAdvise and cudaMemPrefetchAsync take a struct cudaMemLocation
 * {type, id} by value (cuda_runtime_api.h 13.0: lines 7399 and 7152); before, an int device (12.9:
 * lines 8242 and 8047). The constants are driver_types.h's, the same in 12.9 and 13.0. */
#ifndef UM_CUDART_MAJOR
#error "UM_CUDART_MAJOR (the libcudart major this links) is required"
#endif
typedef void *cudaStream_t;
typedef int cudaError_t;
struct um_mem_location {
    int type; /* enum cudaMemLocationType: cudaMemLocationTypeDevice = 1 */
    int id;
};
enum {
    UM_ADVISE_SET_PREFERRED_LOCATION = 3, /* cudaMemAdviseSetPreferredLocation */
    UM_ADVISE_SET_ACCESSED_BY = 5,        /* cudaMemAdviseSetAccessedBy */
    UM_ATTR_HOST_PAGE_TABLES = 100,       /* cudaDevAttrPageableMemoryAccessUsesHostPageTables */
    UM_LOCATION_DEVICE = 1,               /* cudaMemLocationTypeDevice */
};
extern cudaError_t cudaMallocManaged(void **p, size_t n, unsigned int flags);
extern cudaError_t cudaFree(void *p);
extern cudaError_t cudaGetLastError(void);
extern cudaError_t cudaDeviceGetAttribute(int *value, int attr, int device);
#if UM_CUDART_MAJOR >= 13
extern cudaError_t cudaMemAdvise(const void *p, size_t n, int advice, struct um_mem_location location);
extern cudaError_t cudaMemPrefetchAsync(const void *p, size_t n, struct um_mem_location location, unsigned int flags,
                                        cudaStream_t stream);
#else
extern cudaError_t cudaMemAdvise(const void *p, size_t n, int advice, int device);
extern cudaError_t cudaMemPrefetchAsync(const void *p, size_t n, int device, cudaStream_t stream);
#endif
/* The advice and the prefetch; nonzero where any of them failed. A failed call leaves its error as the
 * thread's last error, which the next kernel launch's check (cudaGetLastError) would raise as its own:
 * it is read off here, and the failure counted (um_hint_failures), not raised. Prefetch needs
 * concurrentManagedAccess; without it the memory is still managed, only not moved ahead. */
static int um_hint(void *p, size_t n, int device, cudaStream_t s) {
    cudaError_t a, b, c;
#if UM_CUDART_MAJOR >= 13
    struct um_mem_location loc = {UM_LOCATION_DEVICE, device};
    a = cudaMemAdvise(p, n, UM_ADVISE_SET_PREFERRED_LOCATION, loc);
    b = cudaMemAdvise(p, n, UM_ADVISE_SET_ACCESSED_BY, loc);
    c = cudaMemPrefetchAsync(p, n, loc, 0, s);
#else
    a = cudaMemAdvise(p, n, UM_ADVISE_SET_PREFERRED_LOCATION, device);
    b = cudaMemAdvise(p, n, UM_ADVISE_SET_ACCESSED_BY, device);
    c = cudaMemPrefetchAsync(p, n, device, s);
#endif
    if (a || b || c) {
        cudaGetLastError();
        return 1;
    }
    return 0;
}
/* 1 where the GPU reads pageable host memory through the host's page tables (ATS: GH200, GB200 over
 * NVLink-C2C): managed memory may then exceed GPU memory without thrashing a PCIe link. */
static int um_attr(int device) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, UM_ATTR_HOST_PAGE_TABLES, device) != 0) {
        cudaGetLastError();
        return -1;
    }
    return v;
}
#endif

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t cap_bytes = 0, in_use = 0, peak = 0;
static unsigned long long n_allocs = 0, n_refused = 0, n_hint_failures = 0;
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
    int hint_failed = use_hints ? um_hint(p, n, device, stream) : 0;
    pthread_mutex_lock(&lock);
    n_hint_failures += hint_failed;
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
unsigned long long um_hint_failures(void) { return n_hint_failures; }
int um_coherent(int device) { return um_attr(device); }
