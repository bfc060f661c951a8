#define _DEFAULT_SOURCE /* madvise */
#include "memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "fatal.h"

/* The CUDA parts sit in #ifdef blocks inside the functions: without CUDA,
 * nte_memory_init refuses NTE_CUDA, so no buffer or stream of that kind
 * ever exists and the host paths are the only ones reached. */
#ifdef NTE_WITH_CUDA
#include <cuda_runtime_api.h>

#define NTE_CUDA(call)                                                                            \
  do {                                                                                            \
    cudaError_t nte_err_ = (call);                                                                \
    if (nte_err_ != cudaSuccess) nte_fatal("%s failed: %s", #call, cudaGetErrorString(nte_err_)); \
  } while (0)
#define STREAM(mem) ((cudaStream_t)(mem)->stream)
#endif

int nte_cuda_built(void) {
#ifdef NTE_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

/* Host allocations are page-aligned, as cudaMalloc's are, so that -u 0
 * means aligned on both. From 4 MiB they ask for transparent huge pages, as
 * NumPy's allocator does (and so python -m a2a.bench's buffers): with 4 KiB
 * pages the copies of 16 MiB exchanges ran about 20% slower here. */
static void* host_alloc(size_t bytes) {
  enum { kHuge = 2u << 20 };
  const int large = bytes >= 2 * (size_t)kHuge;
  void* p = NULL;
  if (posix_memalign(&p, large ? kHuge : 4096, bytes ? bytes : 1) != 0)
    nte_fatal("out of host memory allocating %zu bytes", bytes);
#ifdef MADV_HUGEPAGE
  if (large) madvise(p, bytes, MADV_HUGEPAGE); /* a hint: without it, plain pages */
#endif
  return p;
}

/* "model name" of /proc/cpuinfo, else "cpu". */
static void cpu_model(char* out, size_t out_size) {
  snprintf(out, out_size, "cpu");
  FILE* f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    const char* colon = strchr(line, ':');
    if (strncmp(line, "model name", 10) != 0 || !colon) continue;
    colon += 1 + strspn(colon + 1, " \t");
    snprintf(out, out_size, "%s", colon);
    out[strcspn(out, "\n")] = '\0';
    break;
  }
  fclose(f);
}

int nte_memory_init(nte_memory* mem, nte_memory_kind kind, int device, int null_stream, double timeout_s, char* err,
                    size_t err_size) {
  memset(mem, 0, sizeof *mem);
  mem->kind = NTE_HOST;
  mem->device = -1;
  mem->timeout_s = timeout_s;
  if (kind == NTE_HOST) return 0;
#ifdef NTE_WITH_CUDA
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    snprintf(err, err_size, "-D cuda: no usable CUDA device (cudaGetDeviceCount: %s)", cudaGetErrorString(status));
    return -1;
  }
  if (count == 1) device = 0; /* the launcher gave each rank its own GPU (CUDA_VISIBLE_DEVICES) */
  if (device >= count) {
    snprintf(err, err_size,
             "-D cuda: one GPU per rank needs GPU %d (this rank's index on its host), but %d %s visible", device,
             count, count == 1 ? "is" : "are");
    return -1;
  }
  status = cudaSetDevice(device);
  if (status == cudaSuccess && !null_stream)
    status = cudaStreamCreateWithFlags((cudaStream_t*)&mem->stream, cudaStreamNonBlocking);
  if (status != cudaSuccess) {
    snprintf(err, err_size, "-D cuda: cannot use GPU %d: %s", device, cudaGetErrorString(status));
    return -1;
  }
  mem->kind = NTE_CUDA;
  mem->device = device;
  return 0;
#else
  (void)device;
  (void)null_stream;
  snprintf(err, err_size,
           "-D cuda: nccl_tests_ext was built without CUDA (NTE_WITH_CUDA=OFF, or no CUDA toolkit when it was "
           "configured); reconfigure it with the CUDA toolkit installed, or run with -D host");
  return -1;
#endif
}

void nte_memory_finalize(nte_memory* mem) {
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA && mem->stream) cudaStreamDestroy(STREAM(mem));
#endif
  mem->stream = NULL;
}

nte_buffer nte_alloc(const nte_memory* mem, size_t bytes, size_t offset) {
  nte_buffer buf = {NULL, NULL, bytes, offset};
  buf.host = (char*)host_alloc(bytes + offset) + offset;
  buf.data = buf.host;
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA) {
    void* device = NULL;
    NTE_CUDA(cudaMalloc(&device, bytes + offset ? bytes + offset : 1));
    buf.data = (char*)device + offset;
  }
#else
  (void)mem;
#endif
  return buf;
}

void nte_free(const nte_memory* mem, nte_buffer* buf) {
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA && buf->data) NTE_CUDA(cudaFree((char*)buf->data - buf->offset));
#else
  (void)mem;
#endif
  if (buf->host) free((char*)buf->host - buf->offset);
  buf->data = buf->host = NULL;
}

void nte_upload(const nte_memory* mem, const nte_buffer* buf) {
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA && buf->bytes)
    NTE_CUDA(cudaMemcpyAsync(buf->data, buf->host, buf->bytes, cudaMemcpyHostToDevice, STREAM(mem)));
#else
  (void)mem, (void)buf;
#endif
}

void nte_download(const nte_memory* mem, const nte_buffer* buf) {
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA && buf->bytes) {
    NTE_CUDA(cudaMemcpyAsync(buf->host, buf->data, buf->bytes, cudaMemcpyDeviceToHost, STREAM(mem)));
    nte_synchronize(mem);
  }
#else
  (void)mem, (void)buf;
#endif
}

/* Polls rather than cudaStreamSynchronize: a NCCL kernel whose peer never
 * comes would block that forever. */
void nte_synchronize(const nte_memory* mem) {
#ifdef NTE_WITH_CUDA
  if (mem->kind != NTE_CUDA) return;
  struct timespec start, now, nap = {0, 20000};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    const cudaError_t status = cudaStreamQuery(STREAM(mem));
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) nte_fatal("waiting for the CUDA stream: %s", cudaGetErrorString(status));
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double waited = (double)(now.tv_sec - start.tv_sec) + 1e-9 * (double)(now.tv_nsec - start.tv_nsec);
    if (waited > mem->timeout_s)
      nte_fatal("the CUDA stream did not finish within %.0f s (-T / A2A_TIMEOUT_S)", mem->timeout_s);
    nanosleep(&nap, NULL);
  }
#else
  (void)mem;
#endif
}

void nte_describe_device(const nte_memory* mem, const char* where, char* out, size_t out_size) {
#ifdef NTE_WITH_CUDA
  if (mem->kind == NTE_CUDA) {
    struct cudaDeviceProp prop;
    NTE_CUDA(cudaGetDeviceProperties(&prop, mem->device));
    snprintf(out, out_size, "device %2d [%04x:%02x:%02x] %s", mem->device, prop.pciDomainID, prop.pciBusID,
             prop.pciDeviceID, prop.name);
    return;
  }
#else
  (void)mem;
#endif
  char model[256];
  cpu_model(model, sizeof model);
  snprintf(out, out_size, "device cpu [%s] %s", where, model);
}

/* The options allow -G only with -D cuda, which exists only in a CUDA build. */
void nte_graph_begin(const nte_memory* mem) {
#ifdef NTE_WITH_CUDA
  NTE_CUDA(cudaStreamBeginCapture(STREAM(mem), cudaStreamCaptureModeThreadLocal));
#else
  (void)mem;
  nte_fatal("CUDA graphs (-G) need a build with CUDA");
#endif
}

void* nte_graph_end(const nte_memory* mem) {
#ifdef NTE_WITH_CUDA
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  NTE_CUDA(cudaStreamEndCapture(STREAM(mem), &graph));
  NTE_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  NTE_CUDA(cudaGraphDestroy(graph));
  return (void*)exec;
#else
  (void)mem;
  nte_fatal("CUDA graphs (-G) need a build with CUDA");
#endif
}

void nte_graph_launch(const nte_memory* mem, void* graph) {
#ifdef NTE_WITH_CUDA
  NTE_CUDA(cudaGraphLaunch((cudaGraphExec_t)graph, STREAM(mem)));
#else
  (void)mem, (void)graph;
  nte_fatal("CUDA graphs (-G) need a build with CUDA");
#endif
}

void nte_graph_destroy(void* graph) {
#ifdef NTE_WITH_CUDA
  if (graph) NTE_CUDA(cudaGraphExecDestroy((cudaGraphExec_t)graph));
#else
  (void)graph;
#endif
}
