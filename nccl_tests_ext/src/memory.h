/* Where the benchmarks' buffers live: host memory (moved over MPI), or the
 * memory of one CUDA device per rank (moved over NCCL). The CUDA half is
 * compiled only with NTE_WITH_CUDA; without it, asking for CUDA is an error
 * that says so. */
#ifndef NTE_MEMORY_H_
#define NTE_MEMORY_H_

#include <stddef.h>

typedef enum { NTE_HOST = 0, NTE_CUDA = 1 } nte_memory_kind;

/* A buffer of `bytes` at `data` (device or host memory), with a host mirror
 * at `host` that the data are written into and read from (the same memory
 * for NTE_HOST). `data` and `host` start `offset` bytes into their
 * allocations (nccl-tests' -u misalignment). */
typedef struct {
  void* data;
  void* host;
  size_t bytes;
  size_t offset;
} nte_buffer;

/* Memory of this process: kind, CUDA device and stream. */
typedef struct {
  nte_memory_kind kind;
  int device;       /* CUDA device ordinal, -1 on the host */
  void* stream;     /* cudaStream_t of the collectives (NULL: the legacy default stream) */
  double timeout_s; /* bound on every wait for the stream */
} nte_memory;

/* 1 when this build has the CUDA half. */
int nte_cuda_built(void);

/* Selects `device` (this rank's index on its host; 0 where a rank sees a
 * single GPU) and creates the stream (NULL with null_stream). Returns 0, or
 * -1 with a message in err. */
int nte_memory_init(nte_memory* mem, nte_memory_kind kind, int device, int null_stream, double timeout_s, char* err,
                    size_t err_size);
void nte_memory_finalize(nte_memory* mem);

/* Allocates `bytes` (+ offset) in mem and on the host; aborts on failure. */
nte_buffer nte_alloc(const nte_memory* mem, size_t bytes, size_t offset);
void nte_free(const nte_memory* mem, nte_buffer* buf);
/* host -> data, and data -> host (waits); no-ops on the host. */
void nte_upload(const nte_memory* mem, const nte_buffer* buf);
void nte_download(const nte_memory* mem, const nte_buffer* buf);
/* Waits for every call enqueued on the stream, at most timeout_s. */
void nte_synchronize(const nte_memory* mem);

/* nccl-tests' device fields of the rank line: "device  0 [0000:07:00] NVIDIA
 * H100 80GB HBM3" on CUDA, "device cpu [<where>] <CPU model>" on the host. */
void nte_describe_device(const nte_memory* mem, const char* where, char* out, size_t out_size);

/* CUDA graphs (-G): capture what is enqueued on the stream between begin
 * and end, then launch it. */
void nte_graph_begin(const nte_memory* mem);
void* nte_graph_end(const nte_memory* mem);
void nte_graph_launch(const nte_memory* mem, void* graph);
void nte_graph_destroy(void* graph);

#endif /* NTE_MEMORY_H_ */
