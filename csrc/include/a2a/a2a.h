/*
 * a2a: all-to-all collectives for Mixture-of-Experts.
 *
 * The C ABI of liba2a. Handles are opaque, every function returns an
 * a2a_status_t, and a failed call leaves a human-readable message (rank, peer,
 * sizes, dtype) in a2a_get_last_error(), which is per thread. No C++ exception
 * ever crosses this boundary.
 *
 * All collectives are blocking and collective over the communicator: every
 * rank must call the same function with matching arguments. Arguments that
 * must agree across ranks (dtype, counts, algorithm) are checked on every call;
 * a mismatch fails with A2A_ERROR_MISMATCH on every rank instead of hanging.
 * Every wait is bounded by A2A_TIMEOUT_S seconds (environment; default 300).
 *
 * The caller owns all memory: outputs and workspaces are passed in. Use the
 * *_workspace_size() queries to size the workspace (NULL/0 when it is 0).
 */
#ifndef A2A_A2A_H_
#define A2A_A2A_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define A2A_API __declspec(dllexport)
#else
#define A2A_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define A2A_VERSION_MAJOR 0
#define A2A_VERSION_MINOR 1
#define A2A_VERSION_PATCH 0

typedef enum {
  A2A_SUCCESS = 0,
  A2A_ERROR_INVALID_ARGUMENT = 1, /* bad pointer, count, dtype, shape, axis */
  A2A_ERROR_MISMATCH = 2,         /* arguments disagree across ranks */
  A2A_ERROR_TIMEOUT = 3,          /* a wait exceeded A2A_TIMEOUT_S */
  A2A_ERROR_TRANSPORT = 4,        /* the MPI / NCCL layer reported an error */
  A2A_ERROR_UNSUPPORTED = 5,      /* not compiled in, or not supported here */
  A2A_ERROR_REMOTE = 6,           /* another rank rejected its own input */
  A2A_ERROR_INTERNAL = 7
} a2a_status_t;

typedef enum {
  A2A_FLOAT32 = 0,
  A2A_FLOAT64 = 1,
  A2A_FLOAT16 = 2,
  A2A_BFLOAT16 = 3,
  A2A_INT8 = 4,
  A2A_INT32 = 5,
  A2A_INT64 = 6,
  A2A_UINT8 = 7
} a2a_dtype_t;

typedef enum {
  A2A_ALGO_LINEAR = 0, /* Tutel Algorithm 1: one exchange with every rank */
  A2A_ALGO_2DH = 1     /* Tutel Algorithm 2: intra-node then inter-node */
} a2a_algo_t;

typedef struct a2a_comm* a2a_comm_t;
typedef struct a2a_v_plan* a2a_v_plan_t;

/* Versioned communicator options. Always start from A2A_COMM_CONFIG_INIT so
 * fields added later keep their defaults. */
typedef struct {
  size_t struct_size;    /* sizeof(a2a_comm_config_t) */
  int local_size;        /* ranks per node; 0 = env A2A_LOCAL_SIZE, else MPI shared-memory split */
  double timeout_s;      /* bound on every wait; <= 0 = env A2A_TIMEOUT_S, else 300 */
  int use_mpi_datatypes; /* 1: strided layouts go on the wire as MPI datatypes; 0: packed by copies;
                            -1: env A2A_MPI_DATATYPES (default 1) */
} a2a_comm_config_t;

#define A2A_COMM_CONFIG_INIT {sizeof(a2a_comm_config_t), 0, 0.0, -1}

A2A_API const char* a2a_get_last_error(void);
A2A_API const char* a2a_status_string(a2a_status_t status);
A2A_API size_t a2a_dtype_size(a2a_dtype_t dtype);
/* Which optional parts were compiled in, as a short "key=value;..." string. */
A2A_API const char* a2a_build_config(void);

/* Creates a communicator over an MPI communicator. mpi_comm points to an
 * MPI_Comm (pass &comm, so the header does not depend on mpi.h). The MPI
 * communicator is duplicated; it may be freed after this call. Collective. */
A2A_API a2a_status_t a2a_comm_create_mpi(const void* mpi_comm, const a2a_comm_config_t* config,
                                         a2a_comm_t* comm);
A2A_API a2a_status_t a2a_comm_destroy(a2a_comm_t comm);
/* Topology: rank, size, local_rank, local_size, node, num_nodes (any may be NULL). */
A2A_API a2a_status_t a2a_comm_topology(a2a_comm_t comm, int* rank, int* size, int* local_rank,
                                       int* local_size, int* node, int* num_nodes);

/* MPI_Alltoall semantics: send holds size * count elements, the block of
 * `count` elements at i * count goes to rank i; recv receives rank i's block
 * at i * count. Out of place (send != recv). */
A2A_API a2a_status_t a2a_all_to_all_workspace_size(a2a_comm_t comm, size_t count, a2a_dtype_t dtype,
                                                   a2a_algo_t algo, size_t* bytes);
A2A_API a2a_status_t a2a_all_to_all(a2a_comm_t comm, const void* send, void* recv, size_t count,
                                    a2a_dtype_t dtype, a2a_algo_t algo, void* workspace,
                                    size_t workspace_bytes);

/* JAX lax.all_to_all(..., tiled=True) semantics on a C-contiguous array of `ndim` dims with the
 * same shape on every rank: split `split_axis` into size blocks, block i goes
 * to rank i, received blocks are concatenated along `concat_axis` in rank
 * order. out_shape (ndim entries, may be NULL) receives the output shape. */
A2A_API a2a_status_t a2a_all_to_all_flex_workspace_size(a2a_comm_t comm, const int64_t* shape, int ndim,
                                                        int split_axis, int concat_axis,
                                                        a2a_dtype_t dtype, a2a_algo_t algo,
                                                        size_t* bytes);
A2A_API a2a_status_t a2a_all_to_all_flex(a2a_comm_t comm, const void* send, void* recv,
                                         const int64_t* shape, int ndim, int split_axis,
                                         int concat_axis, a2a_dtype_t dtype, a2a_algo_t algo,
                                         void* workspace, size_t workspace_bytes);

/* MPI_Alltoallv semantics with the count exchange built in. Counts are in rows
 * of row_elements elements (pass 1 for plain element counts); row_elements,
 * dtype and algo must agree across ranks. Creating the plan is collective: it
 * exchanges send_counts (size entries) and, for 2DH, the intra-node counts. A plan can be executed many times with buffers of
 * the planned sizes; the comm must outlive it. Blocks are packed in rank
 * order on both sides (displacements are prefix sums of the counts). */
A2A_API a2a_status_t a2a_v_plan_create(a2a_comm_t comm, const int64_t* send_counts, size_t row_elements,
                                       a2a_dtype_t dtype, a2a_algo_t algo, a2a_v_plan_t* plan);
A2A_API a2a_status_t a2a_v_plan_recv_counts(a2a_v_plan_t plan, int64_t* recv_counts);
A2A_API a2a_status_t a2a_v_plan_workspace_size(a2a_v_plan_t plan, size_t* bytes);
A2A_API a2a_status_t a2a_all_to_all_v(a2a_v_plan_t plan, const void* send, void* recv, void* workspace,
                                      size_t workspace_bytes);
A2A_API a2a_status_t a2a_v_plan_destroy(a2a_v_plan_t plan);

/* Makes every rank of the collective fail with A2A_ERROR_REMOTE instead of
 * waiting: a binding that rejects its input before reaching the core calls
 * this in place of the collective (op: "all_to_all", "all_to_all_flex",
 * "all_to_all_v"), then reports its own error. Returns A2A_ERROR_REMOTE. */
A2A_API a2a_status_t a2a_comm_report_invalid(a2a_comm_t comm, const char* op, const char* message);

#ifdef __cplusplus
}
#endif

#endif /* A2A_A2A_H_ */
