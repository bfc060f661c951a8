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

/* Element-wise reduction of the dense collectives. */
typedef enum { A2A_SUM = 0, A2A_MAX = 1, A2A_MIN = 2 } a2a_reduce_op_t;

typedef struct a2a_comm* a2a_comm_t;
typedef struct a2a_v_plan* a2a_v_plan_t;
typedef struct a2a_v_exchange* a2a_v_exchange_t;
typedef struct a2a_low_latency* a2a_low_latency_t;

/* Where buffers live: host memory, or device memory of one CUDA device. */
typedef enum { A2A_DEVICE_CPU = 0, A2A_DEVICE_CUDA = 1 } a2a_device_type_t;

/* What moves the bytes between ranks. A2A_TRANSPORT_MPI with A2A_DEVICE_CUDA
 * stages device buffers through page-locked host memory (for clusters
 * without NCCL, and for several ranks sharing one GPU). */
typedef enum { A2A_TRANSPORT_MPI = 0, A2A_TRANSPORT_NCCL = 1, A2A_TRANSPORT_EXTERNAL = 2 } a2a_transport_t;

/* Versioned communicator options. Always start from A2A_COMM_CONFIG_INIT so
 * fields added later keep their defaults. */
typedef struct {
  size_t struct_size;    /* sizeof(a2a_comm_config_t) */
  int local_size;        /* ranks per node; 0 = env A2A_LOCAL_SIZE, else detected (MPI shared-memory split;
                            for a2a_comm_create_nccl: LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, else all) */
  double timeout_s;      /* bound on every wait; <= 0 = env A2A_TIMEOUT_S, else 300 */
  int use_mpi_datatypes; /* 1: strided layouts go on the wire as MPI datatypes; 0: packed by copies;
                            -1: env A2A_MPI_DATATYPES (default 1). Host MPI communicators only. */
  int device_type;       /* a2a_device_type_t of the collectives' buffers (default CPU) */
  int transport;         /* a2a_transport_t (default MPI; NCCL needs device_type CUDA) */
  int cuda_device;       /* CUDA device ordinal; -1 = the calling thread's current device */
  int cross_check;       /* 1: every collective checks that all ranks called it alike (the linear exchange carries
                            the check; other algorithms add a round); 0: no cross-rank check, as in MPI and NCCL
                            (a rank's bad input fails on that rank alone and its peers time out); -1: env
                            A2A_CROSS_CHECK (default 1). Equal on every rank (checked at creation). */
} a2a_comm_config_t;

#define A2A_COMM_CONFIG_INIT {sizeof(a2a_comm_config_t), 0, 0.0, -1, A2A_DEVICE_CPU, A2A_TRANSPORT_MPI, -1, -1}

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
/* NCCL bootstrap without MPI (e.g. through torch.distributed): one rank calls
 * a2a_nccl_unique_id, every rank receives those A2A_NCCL_UNIQUE_ID_BYTES
 * bytes by its own means, then all `size` ranks call a2a_comm_create_nccl
 * (collective; bounded by the timeout). config may be NULL; its device_type
 * and transport are taken as CUDA and NCCL. The argument check of every
 * collective then runs over NCCL too, through a small device buffer, and
 * waits for the stream (communicators made over MPI check over MPI instead;
 * inside CUDA-graph capture only the local checks run). */
#define A2A_NCCL_UNIQUE_ID_BYTES 128
A2A_API a2a_status_t a2a_nccl_unique_id(void* id);
A2A_API a2a_status_t a2a_comm_create_nccl(const void* id, int size, int rank, const a2a_comm_config_t* config,
                                          a2a_comm_t* comm);
/* A transport that the caller provides, for a launcher whose own channel is all
 * there is (torch.distributed over gloo under torchrun, with no MPI): host
 * memory, point-to-point messages. a2a runs every algorithm over it. The
 * channel labels nothing, so the argument check travels as small messages of
 * its own: a round before a call, or, for a call that every rank predicted
 * from the calls they agreed on, posted beside its data (no round; a
 * disagreement there retires the communicator on every rank; docs/algorithms.md,
 * "The predicted check"). Each callback returns A2A_SUCCESS, or a status with a message
 * written into error (error_size bytes, NUL-terminated), which a2a raises on
 * this rank, naming the call.
 *   isend / irecv: post a message of `bytes` bytes (> 0) at `data` to / from
 *     rank `peer` of the communicator made here (sub-communicators map their
 *     ranks to these). Messages between two ranks with one `tag` must match
 *     in the order they were posted; a communicator uses two tags (its data
 *     and its control messages), every one split from it tags of its own. *request identifies the message for wait.
 *   wait: returns when every request completed, or A2A_ERROR_TIMEOUT after
 *     timeout_s seconds (naming the ranks whose messages did not come); a
 *     failed peer should end the wait with an error rather than at the timeout.
 *   release (may be NULL): called once, when the last communicator over
 *     these ops is destroyed.
 * Messages to oneself never reach the callbacks. */
typedef struct {
  size_t struct_size; /* sizeof(a2a_transport_ops_t) */
  const char* name;   /* e.g. "gloo": shown in errors and a2a.Comm's repr (copied) */
  void* user;         /* passed to every callback */
  int (*isend)(void* user, const void* data, size_t bytes, int peer, int tag, int64_t* request, char* error,
               size_t error_size);
  int (*irecv)(void* user, void* data, size_t bytes, int peer, int tag, int64_t* request, char* error,
               size_t error_size);
  int (*wait)(void* user, const int64_t* requests, size_t count, double timeout_s, char* error, size_t error_size);
  void (*release)(void* user);
} a2a_transport_ops_t;
/* A host communicator of `size` ranks over ops (collective: every rank calls
 * it with its own rank). config may be NULL; its device_type and transport
 * are taken as CPU and EXTERNAL; local_size: config, else A2A_LOCAL_SIZE,
 * LOCAL_WORLD_SIZE (torchrun) or OMPI_COMM_WORLD_LOCAL_SIZE, else one node.
 * On failure ops->release is called before returning (not when ops is NULL
 * or ops->struct_size is wrong: then nothing of ops is read). */
A2A_API a2a_status_t a2a_comm_create_external(const a2a_transport_ops_t* ops, int size, int rank,
                                              const a2a_comm_config_t* config, a2a_comm_t* comm);

/* a2a_comm_create_nccl with a host channel beside NCCL for the control
 * values and the argument check (torch.distributed's gloo group under
 * torchrun; the same ops as a2a_comm_create_external, ranks as NCCL's): a
 * call that every rank predicted from the calls they agreed on posts its
 * check as small messages on `control` and enqueues its data at once, with no
 * wait for the stream and no round (docs/algorithms.md, "The predicted
 * check"); host values (all-to-all-v counts, capacities) go over `control`
 * without waiting for the stream. A disagreement in a predicted call retires
 * the communicator on every rank. Collective; control->release as in
 * a2a_comm_create_external. */
A2A_API a2a_status_t a2a_comm_create_nccl_with_control(const void* id, int size, int rank,
                                                       const a2a_transport_ops_t* control,
                                                       const a2a_comm_config_t* config, a2a_comm_t* comm);
A2A_API a2a_status_t a2a_comm_destroy(a2a_comm_t comm);
/* The CUDA stream (a cudaStream_t; NULL = the legacy default stream) of the
 * following collectives on a CUDA communicator. They are enqueued on it and
 * return without waiting for the data, except: creating an all-to-all-v plan
 * (the counts come back to the host) and the staged MPI transport (which
 * waits for the stream before each exchange). Ignored on the CPU. */
A2A_API a2a_status_t a2a_comm_set_stream(a2a_comm_t comm, void* stream);
/* device_type (a2a_device_type_t), transport (a2a_transport_t) and CUDA
 * device ordinal (-1 on the CPU) of a communicator; any may be NULL. */
A2A_API a2a_status_t a2a_comm_device(a2a_comm_t comm, int* device_type, int* transport, int* cuda_device);
/* Topology: rank, size, local_rank, local_size, node, num_nodes (any may be NULL). */
A2A_API a2a_status_t a2a_comm_topology(a2a_comm_t comm, int* rank, int* size, int* local_rank,
                                       int* local_size, int* node, int* num_nodes);
/* Why algo A2A_ALGO_2DH refuses this communicator: its nodes are not equal
 * blocks of consecutive ranks (detected so, as on a cluster whose nodes hold
 * different numbers of its ranks). *reason is "" when they are; the string
 * lives as long as the communicator. The same on every rank. */
A2A_API a2a_status_t a2a_comm_irregular_reason(a2a_comm_t comm, const char** reason);
/* *on = 1 when the communicator's collectives check that all ranks called
 * them alike (a2a_comm_config_t.cross_check), else 0. */
A2A_API a2a_status_t a2a_comm_cross_check(a2a_comm_t comm, int* on);

/* What calls cost (README, "What calls cost: counters"): counted where the cost is paid,
 * on every device; the CPU path counts the host waits a GPU would pay at the
 * same places, since it runs the same code. Monotonic from creation (of the
 * communicator, or of the process for the totals): take differences.
 *   calls            entries into the library (per communicator: calls on it)
 *   collectives      collectives and checked calls started on it
 *   data_rounds      exchanges (one group of point-to-point messages) and the
 *                    transport's own collectives on the data path
 *   data_messages    point-to-point messages this rank posted to other ranks
 *                    on the data path (a transport's own collective counts a
 *                    round and no message)
 *   control_rounds, control_messages
 *                    the same on the control path (host values: counts, the
 *                    cross-rank check where it goes by round)
 *   check_rounds     rounds run for the cross-rank check alone (counted in
 *                    the control rounds too); 0 where the check travels in
 *                    the collectives' own messages
 *   host_waits       times the host waited for the device (a stream
 *                    synchronization, a value read back)
 *   kernel_calls     device operations enqueued: copies, layout transposes,
 *                    MoE kernels
 *   allocations      buffers the library allocated itself */
typedef struct {
  size_t struct_size; /* sizeof(a2a_counters_t) */
  int64_t calls;
  int64_t collectives;
  int64_t data_rounds;
  int64_t data_messages;
  int64_t control_rounds;
  int64_t control_messages;
  int64_t check_rounds;
  int64_t host_waits;
  int64_t kernel_calls;
  int64_t allocations;
} a2a_counters_t;
#define A2A_COUNTERS_INIT {sizeof(a2a_counters_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
/* A communicator's counters, or with comm NULL the process's (every
 * communicator and the calls made without one). counters->struct_size must
 * be set (A2A_COUNTERS_INIT). */
A2A_API a2a_status_t a2a_counters(a2a_comm_t comm, a2a_counters_t* counters);

/* The color of a rank that joins no new communicator in a2a_comm_split (the
 * value of MPI_UNDEFINED in Open MPI and MPICH). */
#define A2A_UNDEFINED (-32766)

/* MPI_Comm_split semantics: the ranks of comm that pass the same color form a
 * new communicator, ranked by (key, rank in comm). Collective over comm: every
 * rank must call it, those with color A2A_UNDEFINED too, which get *out =
 * NULL. color is otherwise >= 0; keys may repeat. The new communicator is of
 * comm's kind: the same device (CPU or the same CUDA device), transport (its
 * MPI communicator split from comm's own duplicate; its NCCL communicator by
 * ncclCommSplit of comm's), timeout, settings and MPI thread level. It does not
 * depend on comm afterwards: either may be destroyed first.
 * Its nodes come from comm's: when the new ranks on each node of comm are one
 * block of consecutive new ranks, and the blocks are of equal size, local_size
 * is that size, else 1 (e.g. splitting 2 nodes x 4 ranks by parity gives
 * 2 x 2; the ranks of one node give 1 x 4). A bad color, or a failure to
 * create the new communicator on any rank, fails on every rank (the others
 * with A2A_ERROR_REMOTE), and *out stays NULL everywhere. */
A2A_API a2a_status_t a2a_comm_split(a2a_comm_t comm, int color, int key, a2a_comm_t* out);

/* Completes the cross-rank check of the last call on comm where that check
 * was posted rather than waited for (a communicator of MPI and NCCL, once
 * its calls repeat: docs/algorithms.md, "The predicted check"); otherwise
 * does nothing. Where a rank left the call that every rank predicted, fails
 * on every rank, as that call would have, and retires comm. The next call
 * on comm completes it too: this is for the end of a loop. Collective where
 * a check is posted (every rank's last call posted one, or none did). */
A2A_API a2a_status_t a2a_comm_check(a2a_comm_t comm);
/* *on = 1 where comm posts the check of calls that every rank predicted
 * (a2a_comm_check), else 0. */
A2A_API a2a_status_t a2a_comm_predicts_check(a2a_comm_t comm, int* on);

/* Threads. Calls on one communicator must not overlap: a call made while
 * another thread is inside a call on the same communicator fails at once
 * with A2A_ERROR_UNSUPPORTED (MPI forbids concurrent collectives on one
 * communicator too). Calls on different communicators may overlap; where
 * they use MPI, that needs MPI_THREAD_MULTIPLE, and with less the later call
 * fails the same way, naming the level MPI granted. Either failure happens
 * on the rank where the calls overlap only, before anything is sent: the
 * other ranks then time out in that collective. */
typedef enum {
  A2A_MPI_THREAD_NONE = -1, /* the communicator does not use MPI (made from a NCCL unique id) */
  A2A_MPI_THREAD_SINGLE = 0,
  A2A_MPI_THREAD_FUNNELED = 1,
  A2A_MPI_THREAD_SERIALIZED = 2,
  A2A_MPI_THREAD_MULTIPLE = 3
} a2a_mpi_thread_level_t;
/* The thread support MPI granted the process (MPI_Query_thread when the
 * communicator was created), as an a2a_mpi_thread_level_t. */
A2A_API a2a_status_t a2a_comm_mpi_thread_level(a2a_comm_t comm, int* level);

/* MPI_Alltoall semantics: send holds size * count elements, the block of
 * `count` elements at i * count goes to rank i; recv receives rank i's block
 * at i * count. Out of place (send != recv). */
A2A_API a2a_status_t a2a_all_to_all_workspace_size(a2a_comm_t comm, size_t count, a2a_dtype_t dtype,
                                                   a2a_algo_t algo, size_t* bytes);
A2A_API a2a_status_t a2a_all_to_all(a2a_comm_t comm, const void* send, void* recv, size_t count,
                                    a2a_dtype_t dtype, a2a_algo_t algo, void* workspace,
                                    size_t workspace_bytes);

/* The dense collectives, on the communicator's transport (MPI, NCCL, or
 * staged MPI) and device, with the same checks as the all-to-alls:
 * - all_gather: send holds count elements; recv (size * count) receives
 *   rank i's elements at i * count (MPI_Allgather, ncclAllGather).
 * - all_reduce: recv[j] = op over ranks of send[j], count elements; send ==
 *   recv reduces in place (MPI_Allreduce, ncclAllReduce).
 * - reduce_scatter: send holds size * count elements; rank i receives in
 *   recv (count) the reduction of block i over ranks
 *   (MPI_Reduce_scatter_block, ncclReduceScatter).
 * float16 and bfloat16 are reduced in float32 and rounded back at every step
 * (over MPI by a user-defined operation), so sums of more than two ranks may
 * round differently from a single float32 sum. */
A2A_API a2a_status_t a2a_all_gather(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype);
A2A_API a2a_status_t a2a_all_reduce(a2a_comm_t comm, const void* send, void* recv, size_t count, a2a_dtype_t dtype,
                                    a2a_reduce_op_t op);
A2A_API a2a_status_t a2a_reduce_scatter(a2a_comm_t comm, const void* send, void* recv, size_t count,
                                        a2a_dtype_t dtype, a2a_reduce_op_t op);

/* The uneven dense collectives, with the same checks. counts (host, size
 * entries, in elements) must be the same on every rank: a rank whose counts
 * differ fails every rank with A2A_ERROR_MISMATCH naming the rank and the
 * entry; a negative count is A2A_ERROR_INVALID_ARGUMENT.
 * - all_gather_v: rank i contributes counts[i] elements (send); recv receives
 *   them at offset counts[0] + ... + counts[i-1] (MPI_Allgatherv with
 *   displacements = prefix sums). counts[rank] is the send count.
 * - reduce_scatter_v: send holds counts[0] + ... + counts[size-1] elements;
 *   rank i receives in recv (counts[i]) the reduction over ranks of its block
 *   (MPI_Reduce_scatter).
 * NCCL has no uneven collectives: they run as a group of ncclBroadcast (one
 * per rank's block) and of ncclReduce. The counts are agreed over the control
 * transport, so on a communicator made from a NCCL unique id they cannot run
 * while its stream is being captured into a CUDA graph (A2A_ERROR_UNSUPPORTED). */
A2A_API a2a_status_t a2a_all_gather_v(a2a_comm_t comm, const void* send, void* recv, const int64_t* counts,
                                      a2a_dtype_t dtype);
A2A_API a2a_status_t a2a_reduce_scatter_v(a2a_comm_t comm, const void* send, void* recv, const int64_t* counts,
                                          a2a_dtype_t dtype, a2a_reduce_op_t op);

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

/* One uneven all-to-all with counts known only to the senders, in two calls.
 * With the linear algorithm over MPI it is one round: the counts travel as
 * the sizes of the data messages, which the receiver probes before it
 * receives. Otherwise (2DH, NCCL) the start exchanges the counts as
 * a2a_v_plan_create does.
 * - a2a_all_to_all_v_start (collective): sends send_counts[i] rows of
 *   row_elements elements from `send` (blocks in rank order; leave it
 *   unchanged until the finish) to rank i, and writes to recv_counts (size
 *   entries) how many rows each rank sends here. row_elements, dtype and
 *   algo must agree across ranks.
 * - Size recv from recv_counts, then a2a_all_to_all_v_finish receives the
 *   rows (blocks in rank order) and releases the exchange, also on error.
 *   workspace: a2a_v_exchange_workspace_size bytes (2DH only; 0 otherwise).
 * - a2a_all_to_all_v_drop releases an exchange without receiving: its rows
 *   are discarded, and the other ranks complete normally.
 * Between the start and the finish or drop, every other call on the comm
 * fails with A2A_ERROR_INVALID_ARGUMENT. */
A2A_API a2a_status_t a2a_all_to_all_v_start(a2a_comm_t comm, const void* send, const int64_t* send_counts,
                                            size_t row_elements, a2a_dtype_t dtype, a2a_algo_t algo,
                                            int64_t* recv_counts, a2a_v_exchange_t* exchange);
A2A_API a2a_status_t a2a_v_exchange_workspace_size(a2a_v_exchange_t exchange, size_t* bytes);
A2A_API a2a_status_t a2a_all_to_all_v_finish(a2a_v_exchange_t exchange, void* recv, void* workspace,
                                             size_t workspace_bytes);
A2A_API a2a_status_t a2a_all_to_all_v_drop(a2a_v_exchange_t exchange);

/* ------------------------------------------------------------------------
 * MoE routing and dispatch/combine kernels (Tutel's fast encode/decode and the
 * dropless permute). docs/moe_kernels.md shows the layouts.
 *
 * These run on one process's data; only a2a_route with a comm talks to other
 * ranks (to agree on the capacity). Every pointer argument points to memory of
 * the execution device (host memory for A2A_DEVICE_CPU, device memory for
 * A2A_DEVICE_CUDA) unless it says "host". Kernels on CUDA are enqueued on
 * exec->stream and return without waiting, except a2a_route, which reads the
 * per-expert counts back to the host (one stream synchronization, which
 * gives up with A2A_ERROR_TIMEOUT after A2A_TIMEOUT_S seconds), and
 * a2a_route_fixed_dropped (a2a_route_fixed itself does not wait).
 *
 * None of them works in place: an output (rows, y, grad_gates; locations,
 * counts, expert_offsets and the workspace of a2a_route) that shares a byte
 * with any other argument, the routing's arrays included, fails with
 * A2A_ERROR_INVALID_ARGUMENT naming the two.
 * ------------------------------------------------------------------------ */


/* Where a kernel runs. CPU: a pool of threads (num_threads; 0 = env
 * A2A_NUM_THREADS, else every core). CUDA: the calling thread's current
 * device, on `stream` (a cudaStream_t; NULL = the legacy default stream). */
typedef struct {
  size_t struct_size; /* sizeof(a2a_exec_t) */
  int device_type;    /* a2a_device_type_t */
  void* stream;
  int num_threads;
} a2a_exec_t;

#define A2A_EXEC_CPU_INIT {sizeof(a2a_exec_t), A2A_DEVICE_CPU, NULL, 0}

/* `capacity` argument of a2a_route: the dropless (packed) layout. */
#define A2A_CAPACITY_DROPLESS (-1)
/* The capacity of a routing from a2a_route_capacities: one capacity per
 * expert (the ragged layout; expert_offsets are the prefix sums of the
 * capacities). */
#define A2A_CAPACITY_PER_EXPERT (-2)

/* What a2a_route / a2a_route_capacities decided (host). */
typedef struct {
  int64_t capacity;    /* rows per expert (padded layout); -1 dropless; -2 per-expert capacities */
  int64_t num_rows;    /* rows of the dispatched buffer: E * capacity, the sum of the per-expert
                          capacities, or the routed choices */
  int64_t num_dropped; /* routed choices that did not fit their expert's capacity */
} a2a_route_info_t;

/* The routing that the dispatch/combine kernels follow: choice (t, j) of
 * token t (j < top_k) goes to expert e = indices[t, j] (negative: not routed)
 * at slot locations[t, j] of that expert. A choice is kept when
 * 0 <= e and locations[t, j] < counts[e]; it then occupies row
 * expert_offsets[e] + locations[t, j] of the (num_rows, M) dispatched buffer.
 * Expert e owns rows expert_offsets[e] .. expert_offsets[e + 1] - 1; those
 * past counts[e] are padding (none in the dropless layout). With
 * capacity == A2A_CAPACITY_PER_EXPERT the kernels trust expert_offsets to be
 * non-decreasing with expert_offsets[0] = 0, [E] = num_rows and counts[e] <=
 * expert_offsets[e + 1] - expert_offsets[e], as a2a_route_capacities makes
 * them. a2a_route fills locations, counts and expert_offsets. */
typedef struct {
  int64_t num_tokens;             /* T */
  int64_t top_k;                  /* k */
  int64_t num_experts;            /* E */
  const void* indices;            /* (T, k), A2A_INT32 or A2A_INT64 */
  a2a_dtype_t index_dtype;
  const int64_t* locations;       /* (T, k) */
  const int64_t* counts;          /* (E) kept choices per expert */
  const int64_t* expert_offsets;  /* (E + 1) first row of each expert; [E] = num_rows */
  int64_t capacity;               /* rows per expert, -1 dropless, -2 per-expert capacities */
  int64_t num_rows;
} a2a_routing_t;

A2A_API a2a_status_t a2a_route_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k,
                                              int64_t num_experts, size_t* bytes);

/* Computes where every (token, choice) goes. Slots are taken in Tutel's
 * order: all first choices before any second choice, tokens in order, or in
 * token_order (a permutation of 0..T-1, e.g. a stable argsort of descending
 * scores: Batch Prioritized Routing) when it is not NULL.
 *
 * capacity > 0: that many rows per expert. capacity == 0: from
 * capacity_setting x as in Tutel: x > 0: ceil(k * x * T / E); x == 0: the
 * smallest capacity that drops nothing; x < 0: like 0 but at most
 * ceil(k * -x * T / E). capacity == A2A_CAPACITY_DROPLESS: no capacity,
 * experts' rows packed back to back (expert_offsets are the prefix sums of
 * counts).
 *
 * comm (may be NULL) makes the call collective: every rank must pass the same
 * num_experts, top_k, capacity and capacity_setting, and the capacity becomes
 * the maximum over ranks, so that every rank's dispatched buffer has the same
 * shape. Outputs: locations (T, k), counts (E), expert_offsets (E + 1), and
 * info (host). Indices >= num_experts fail with A2A_ERROR_INVALID_ARGUMENT. */
A2A_API a2a_status_t a2a_route(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices,
                               a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                               int64_t num_experts, const int64_t* token_order, int64_t capacity,
                               double capacity_setting, void* workspace, size_t workspace_bytes,
                               int64_t* locations, int64_t* counts, int64_t* expert_offsets,
                               a2a_route_info_t* info);

/* a2a_route, and a copy of counts on the host: host_counts (num_experts
 * int64, host memory even on CUDA, sharing no byte with the other arguments)
 * receives the kept choices per expert, which a2a_route knows on the host
 * once its one wait for the device is over. A caller that sizes its
 * exchanges by them (a dropless layer's all-to-all-v counts) then needs no
 * second read of the device. A NULL host_counts fails with
 * A2A_ERROR_INVALID_ARGUMENT (on every rank with a comm, like any bad
 * argument). */
A2A_API a2a_status_t a2a_route_host_counts(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices,
                                           a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                                           int64_t num_experts, const int64_t* token_order, int64_t capacity,
                                           double capacity_setting, void* workspace, size_t workspace_bytes,
                                           int64_t* locations, int64_t* counts, int64_t* expert_offsets,
                                           int64_t* host_counts, a2a_route_info_t* info);

/* a2a_route with one capacity per expert (DynaMoE's per-expert capacity
 * factors): `capacities` (host, num_experts entries, each >= 0; 0 gives the
 * expert no row) instead of one capacity. The dispatched buffer is ragged:
 * expert e owns rows expert_offsets[e] .. expert_offsets[e] + capacity[e] - 1
 * (expert_offsets are the prefix sums of the capacities; num_rows is their
 * sum), its first counts[e] = min(demand, capacity[e]) rows hold its kept
 * choices in slot order and the rest are padding. info->capacity is
 * A2A_CAPACITY_PER_EXPERT. With a comm the call is collective like a2a_route
 * (every rank must pass the same num_experts and top_k, and call this entry
 * point, not a2a_route) and each expert's capacity becomes the maximum over
 * the ranks, so that every rank's ragged layout is the same. final_capacities
 * (host, num_experts entries, may be NULL or the same array as capacities)
 * receives the capacities used. */
A2A_API a2a_status_t a2a_route_capacities(const a2a_exec_t* exec, a2a_comm_t comm, const void* indices,
                                          a2a_dtype_t index_dtype, int64_t num_tokens, int64_t top_k,
                                          int64_t num_experts, const int64_t* token_order,
                                          const int64_t* capacities, void* workspace, size_t workspace_bytes,
                                          int64_t* locations, int64_t* counts, int64_t* expert_offsets,
                                          int64_t* final_capacities, a2a_route_info_t* info);

/* a2a_route at one capacity (> 0), local (no comm), without waiting for the
 * device: the layout follows from the capacity alone (num_rows =
 * num_experts * capacity, expert_offsets[e] = e * capacity), so everything,
 * counts = min(demand, capacity) included, is computed on the execution
 * device, and on CUDA the call only enqueues work on exec->stream (nothing is
 * read back; a CUDA graph may capture it). The same locations, counts and
 * expert_offsets as a2a_route with that capacity. What cannot wait to be
 * known stays in the workspace: the number of dropped choices and any bad
 * input. An index >= num_experts is not routed (its location is -1), and with
 * a token_order that is not a permutation no choice is, so the tables are
 * always safe for the kernels; a2a_route_fixed_dropped then fails with
 * A2A_ERROR_INVALID_ARGUMENT naming it, as a2a_route would have. Keep the
 * workspace until then.
 *
 * capacity == A2A_CAPACITY_DROPLESS: the dropless (packed) layout of
 * a2a_route with that capacity, but with num_rows = T * k, a bound known
 * without the device: counts[e] = the routed choices of expert e,
 * expert_offsets[e] = counts[0] + .. + counts[e - 1] for e < E, and
 * expert_offsets[E] = T * k. Where every choice is routed (a top-k's
 * indices) that is the dropless layout itself; otherwise the rows past the
 * routed ones are the last expert's padding. Give the kernels this routing
 * with capacity A2A_CAPACITY_PER_EXPERT (which it satisfies), so that
 * a2a_moe_dispatch zeroes those rows. Nothing is dropped. */
A2A_API a2a_status_t a2a_route_fixed(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype,
                                     int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                     const int64_t* token_order, int64_t capacity, void* workspace,
                                     size_t workspace_bytes, int64_t* locations, int64_t* counts,
                                     int64_t* expert_offsets);

/* What an a2a_route_fixed of this shape left in `workspace`: *num_dropped
 * (host), the routed choices that did not fit, or A2A_ERROR_INVALID_ARGUMENT
 * for a bad index or token_order. On CUDA this waits for exec->stream
 * (bounded by A2A_TIMEOUT_S): call it where the host waits anyway, or never,
 * when the indices are known to be good (a top-k's) and the count is not
 * needed. */
A2A_API a2a_status_t a2a_route_fixed_dropped(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k,
                                             int64_t num_experts, const void* workspace, size_t workspace_bytes,
                                             int64_t* num_dropped);

/* Dispatch (fast encode; the dropless permute): for every kept choice,
 * rows[row(t, j)] = gate(t, j) * x[t]; padding rows are zeroed. x is (T, M),
 * rows (num_rows, M), both of `dtype` (float32, float64, float16, bfloat16).
 * gates (T, k) of gate_dtype (float32, or the same as dtype) may be NULL for
 * a gate of 1. Products are formed in float32 (float64 for float64).
 * dtype A2A_UINT8 moves rows of M opaque bytes (M a multiple of 4, gates
 * NULL), bit for bit: how packed FP8 rows (a2a_fp8_packed_layout) are
 * dispatched. */
A2A_API a2a_status_t a2a_moe_dispatch(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* x,
                                      a2a_dtype_t dtype, int64_t model_dim, const void* gates,
                                      a2a_dtype_t gate_dtype, void* rows);

/* Combine (fast decode; unpermute): y[t] = sum over kept choices j of
 * gate(t, j) * rows[row(t, j)], accumulated in float32 (float64 for float64);
 * a token with no kept choice gets zeros. */
A2A_API a2a_status_t a2a_moe_combine(const a2a_exec_t* exec, const a2a_routing_t* routing, const void* rows,
                                     a2a_dtype_t dtype, int64_t model_dim, const void* gates,
                                     a2a_dtype_t gate_dtype, void* y);

/* Gradient of the gates (Tutel's K2): grad_gates[t, j] = dot(tokens[t], rows[row(t, j)])
 * for kept choices, 0 otherwise, accumulated in float32 (float64 for
 * float64) and stored as gate_dtype. tokens is (T, M), rows (num_rows, M). */
A2A_API a2a_status_t a2a_moe_gate_grad(const a2a_exec_t* exec, const a2a_routing_t* routing,
                                       const void* tokens, const void* rows, a2a_dtype_t dtype,
                                       int64_t model_dim, a2a_dtype_t gate_dtype, void* grad_gates);

/* ------------------------------------------------------------------------
 * The fused top-k gate: what a top-k router computes from its logits, in one
 * call forward and one backward (Megatron-Core's fused router, in kernels of
 * a2a's own). For every token t of logits (T, E):
 *
 *     scores[t]  = softmax(logits[t])                                  (T, E)
 *     indices[t] = the top_k largest scores, best first, ranked by their
 *                  logits (the softmax's order; unequal logits whose
 *                  rounded scores are equal stay apart); equal logits by
 *                  the lower expert; a row of NaN scores: 0..k-1      (T, k) int64
 *     gates[t]   = scores[t, indices[t]], divided by max(their sum, eps)
 *                  when `normalize` (eps = the dtype's epsilon)        (T, k)
 *     share[e]   = tokens whose first choice is e, / T                 (E)
 *     l_aux      = E * sum_e mean_t(scores[t, e]) * share[e]  (GShard's loss; 0 without tokens)  ()
 *
 * The backward takes the gradients of gates (T, k) and of l_aux (a scalar in
 * device memory), either may be NULL, and gives that of the logits:
 *
 *     dr       = normalize ? (dgates - [sum >= eps] <dgates, gates>) / max(sum, eps) : dgates
 *     dscores  = dr at indices[t] + dl_aux * E / T * share
 *     dlogits  = scores * (dscores - <dscores, scores>)
 *
 * Every array is contiguous, of `dtype` except indices, on the exec's device.
 * float32 and float64 compute in their own precision; float16 and bfloat16 in
 * float32, rounded where torch's ops on them round (the scores, the chosen
 * scores' sum, each gate). The loss's sums are float64.
 * The workspace (a2a_top_k_gate_workspace_size bytes, 8-byte aligned) holds
 * the loss's per-expert sums. Nothing is read back to the host. */
typedef struct {
  int64_t num_tokens;  /* T >= 0 */
  int64_t num_experts; /* E >= 1 */
  int64_t top_k;       /* 1 <= k <= E */
  int normalize;       /* gates divided by max(the k scores' sum, eps) */
  a2a_dtype_t dtype;   /* A2A_FLOAT32, A2A_FLOAT64, A2A_FLOAT16 or A2A_BFLOAT16 */
} a2a_top_k_gate_t;

A2A_API a2a_status_t a2a_top_k_gate_workspace_size(const a2a_top_k_gate_t* gate, size_t* bytes);

A2A_API a2a_status_t a2a_top_k_gate(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const void* logits,
                                    void* scores, int64_t* indices, void* gates, void* share, void* l_aux,
                                    void* workspace);

A2A_API a2a_status_t a2a_top_k_gate_backward(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate,
                                             const void* scores, const int64_t* indices, const void* share,
                                             const void* d_gates, const void* d_l_aux, void* d_logits);

/* ------------------------------------------------------------------------
 * FP8 rows with block scales (DeepSeek-V3's and DeepEP's dispatch format):
 * each row of M channels is cut into blocks of `block` channels along M (the
 * last one shorter when M is not a multiple), and each block is stored as
 * one float32 scale and one float8 code per channel:
 *     amax  = max |x| over the block (NaN ignored), at least MAX * 2^-127
 *     scale = amax / MAX                        (MAX: 448 e4m3, 57344 e5m2)
 *     q     = fp8(x * (MAX / amax))             (0 for an all-zero block)
 * rounded to nearest even and saturating at +-MAX (NaN gives the code 0x7f,
 * whatever its sign); x is read as float32 first. (The floor keeps MAX / amax
 * finite for blocks under ~1e-36, which would otherwise turn their zeros
 * into NaN.) Dequantization gives fp8_to_float(q) * scale, rounded
 * once to the output dtype. docs/moe_kernels.md shows the layouts.
 * ------------------------------------------------------------------------ */

typedef enum {
  A2A_FP8_E4M3 = 0, /* e4m3fn (torch.float8_e4m3fn): no infinity, largest finite 448 */
  A2A_FP8_E5M2 = 1  /* e5m2 (torch.float8_e5m2): largest finite 57344 */
} a2a_fp8_format_t;

/* `rows` quantized rows of `cols` channels: row r's codes at
 * q + r * q_stride (bytes), its ceil(cols / block) scales at
 * scales + r * scale_stride (floats). The strides let q and the scales be
 * separate arrays (q_stride = cols, scale_stride = the block count) or the
 * two parts of packed rows (a2a_fp8_packed_layout). */
typedef struct {
  int64_t rows;
  int64_t cols;
  int64_t block;
  a2a_fp8_format_t format;
  void* q;
  int64_t q_stride;
  float* scales;
  int64_t scale_stride;
} a2a_fp8_rows_t;

/* Packed rows: one row's codes and scales in one run of bytes, so that a
 * dispatch or an exchange moves both at once. A row is
 *     [cols codes | zeros to a multiple of 16 | blocks float32 scales | zeros to 16]
 * with the scales at byte *scale_offset and *row_bytes bytes in all
 * (1056 for cols = 1024, block = 128: 0.52 of a bfloat16 row). */
A2A_API a2a_status_t a2a_fp8_packed_layout(int64_t cols, int64_t block, int64_t* scale_offset, int64_t* row_bytes);

/* x (rows, cols) of dtype (float32, float64, float16, bfloat16), C-contiguous,
 * into out's codes and scales. On CUDA it is enqueued on exec->stream. */
A2A_API a2a_status_t a2a_quantize_fp8(const a2a_exec_t* exec, const void* x, a2a_dtype_t dtype,
                                      const a2a_fp8_rows_t* out);

/* in's codes and scales into y (rows, cols) of dtype, C-contiguous. */
A2A_API a2a_status_t a2a_dequantize_fp8(const a2a_exec_t* exec, const a2a_fp8_rows_t* in, a2a_dtype_t dtype,
                                        void* y);

/* ------------------------------------------------------------------------
 * Low-latency dispatch and combine (DeepEP's low-latency mode): an MoE
 * layer's exchange for a handful of tokens per rank (decoding), where what
 * counts is the microseconds of a call. One message to and one from every
 * rank per call, each carrying its own row count (no count exchange round);
 * on CUDA the messages have a fixed size and the counts stay on the device,
 * so a call never waits for the stream and can be captured into a CUDA graph.
 * docs/moe_kernels.md shows the layouts.
 *
 *   dispatch: x (T, row_bytes) bytes per token (any dtype, or packed FP8
 *             rows), indices (T, top_k) -> recv (local experts, W * max_tokens,
 *             row_bytes): local expert e's rows, source rank by source rank,
 *             each source's in token order; recv_counts (local experts) int64
 *   combine:  expert_out (local experts, W * max_tokens, model_dim) of dtype
 *             (each row the expert's output for that row of recv) -> y (T,
 *             model_dim) = sum over j in order of gates[t, j] * the output
 *             for choice (t, j), accumulated in float32 (float64 for float64)
 *
 * Experts e of rank r are r * L .. r * L + L - 1 (L = num_experts / W). A
 * token sends one row to each distinct expert among its choices (a choice
 * that repeats an expert is combined from the same row); negative indices
 * are not routed. Every call is collective and checked in band: a rank whose
 * input is invalid (T > max_tokens, an index >= num_experts) still sends its
 * messages, marked, so that every other rank fails with A2A_ERROR_REMOTE
 * naming it, and a call that meets another kind of call (dispatch against
 * combine) or another call's messages fails with A2A_ERROR_MISMATCH. On
 * CUDA those checks need the stream: a2a_low_latency_check reads them.
 * ------------------------------------------------------------------------ */

typedef struct {
  size_t struct_size;  /* sizeof(a2a_low_latency_config_t) */
  int64_t max_tokens;  /* T per rank and call, at most */
  int64_t num_experts; /* E, a multiple of the world size */
  int64_t top_k;
  int64_t row_bytes;   /* bytes of a token's row in dispatch (> 0) */
  int64_t model_dim;   /* elements of an output row in combine (> 0) */
  a2a_dtype_t dtype;   /* of the outputs and y (float32, float64, float16, bfloat16) */
} a2a_low_latency_config_t;

#define A2A_LOW_LATENCY_CONFIG_INIT {sizeof(a2a_low_latency_config_t), 0, 0, 0, 0, 0, A2A_FLOAT32}

/* Collective: every rank passes the same config (A2A_ERROR_MISMATCH
 * otherwise). The handle keeps no buffer: the caller passes the workspace
 * (a2a_low_latency_workspace_size bytes of the comm's device memory, zeros
 * before its first use, the same one to a dispatch and the combine that
 * follows it) and the outputs. On CUDA, exec->stream must be the comm's
 * stream (a2a_comm_set_stream). The comm must outlive the handle. */
A2A_API a2a_status_t a2a_low_latency_create(a2a_comm_t comm, const a2a_low_latency_config_t* config,
                                            a2a_low_latency_t* handle);
A2A_API a2a_status_t a2a_low_latency_workspace_size(a2a_low_latency_t handle, size_t* bytes);
/* Rows of recv and of expert_out per local expert: W * max_tokens. */
A2A_API a2a_status_t a2a_low_latency_expert_capacity(a2a_low_latency_t handle, int64_t* rows);
A2A_API a2a_status_t a2a_low_latency_dispatch(a2a_low_latency_t handle, const a2a_exec_t* exec, void* workspace,
                                              size_t workspace_bytes, const void* x, int64_t num_tokens,
                                              const void* indices, a2a_dtype_t index_dtype, void* recv,
                                              int64_t* recv_counts);
/* gates (T, top_k) of float32 or dtype, or NULL for weights of 1. */
A2A_API a2a_status_t a2a_low_latency_combine(a2a_low_latency_t handle, const a2a_exec_t* exec, void* workspace,
                                             size_t workspace_bytes, const void* expert_out, const void* gates,
                                             a2a_dtype_t gate_dtype, void* y);
/* CUDA: waits for the stream, then fails as the last calls' in-band checks
 * would have (a no-op on the CPU, where each call checks itself). */
A2A_API a2a_status_t a2a_low_latency_check(a2a_low_latency_t handle, const a2a_exec_t* exec, const void* workspace,
                                           size_t workspace_bytes);
A2A_API a2a_status_t a2a_low_latency_destroy(a2a_low_latency_t handle);

/* ------------------------------------------------------------------------
 * Expert-specific operators (Hexa-MoE, Sections 3.1-3.2): the experts'
 * matmuls on tokens that stay in their order, with no dispatched buffer.
 * docs/moe_kernels.md shows the layouts.
 *
 * A choice c = t * top_k + j is choice j of token t, routed to expert
 * e_c = indices[t, j] (negative: not routed). An operand's rows are
 * addressed by token (row t of a (T, D) array) or by choice (row c of a
 * (T * top_k, D) array): a2a_es_rows_t. Every operator reads each expert's
 * choices through the re-index vector: the choice ids grouped by expert,
 * expert e's at slots expert_starts[e] .. expert_starts[e] + counts[e] - 1 in
 * Tutel's slot order (all first choices in token order, then all second
 * choices, ...), then -1 up to expert_starts[e + 1], a multiple of `tile`.
 * Accumulation is in float32 (float64 for float64) in a fixed order, so a
 * result does not depend on the threads or the GPU's scheduling.
 * ------------------------------------------------------------------------ */

typedef enum { A2A_ES_ROWS_TOKEN = 0, A2A_ES_ROWS_CHOICE = 1 } a2a_es_rows_t;

/* Layout of an expert weight w (E, ., .): A2A_ES_WEIGHT_NK: w[e] is (N, K)
 * and the product is y = w[e] x (nn.Linear's weight, Tutel's fc1);
 * A2A_ES_WEIGHT_KN: w[e] is (K, N) and y = x w[e] (Tutel's fc2). */
typedef enum { A2A_ES_WEIGHT_NK = 0, A2A_ES_WEIGHT_KN = 1 } a2a_es_weight_layout_t;

/* The re-index vector of one routing (a2a_es_index fills it). */
typedef struct {
  int64_t num_tokens;            /* T */
  int64_t top_k;                 /* k */
  int64_t num_experts;           /* E */
  int64_t tile;                  /* every expert's sub-vector is padded to a multiple of this */
  int64_t num_slots;             /* expert_starts[E] */
  const int64_t* slots;          /* (num_slots) choice ids, -1 = padding */
  const int64_t* expert_starts;  /* (E + 1) */
  const int64_t* counts;         /* (E) routed choices per expert */
} a2a_es_index_t;

/* The most slots a routing of T tokens, k choices, E experts can need:
 * T * k + E * (tile - 1), the length to allocate for `slots`. */
A2A_API a2a_status_t a2a_es_index_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile,
                                           int64_t* max_slots);
A2A_API a2a_status_t a2a_es_index_workspace_size(const a2a_exec_t* exec, int64_t num_tokens, int64_t top_k,
                                                 int64_t num_experts, size_t* bytes);
/* Builds the re-index vector of indices (T, k) (int32 or int64; negative =
 * not routed): slots (max_slots entries, see a2a_es_index_capacity),
 * expert_starts (E + 1) and counts (E); *num_slots (host) receives
 * expert_starts[E]. Indices >= num_experts fail with
 * A2A_ERROR_INVALID_ARGUMENT naming the first (t, j). On CUDA this reads the
 * counts back (one stream synchronization, bounded by A2A_TIMEOUT_S). */
A2A_API a2a_status_t a2a_es_index(const a2a_exec_t* exec, const void* indices, a2a_dtype_t index_dtype,
                                  int64_t num_tokens, int64_t top_k, int64_t num_experts, int64_t tile,
                                  void* workspace, size_t workspace_bytes, int64_t* slots, int64_t max_slots,
                                  int64_t* expert_starts, int64_t* counts, int64_t* num_slots);

/* ESMM: for every routed choice c of expert e,
 *   r_c = gate_c * (w[e] x[row(c)] + bias[e])       (K inputs -> N outputs)
 * x is (T, K) by token or (T * k, K) by choice (x_rows); w (E, N, K) or
 * (E, K, N) (w_layout); bias (E, N) or NULL; gates (T, k) of float32 or
 * dtype, or NULL for a gate of 1. y_rows = A2A_ES_ROWS_CHOICE: y (T * k, N),
 * y[c] = r_c, zeros for a choice not routed. y_rows = A2A_ES_ROWS_TOKEN:
 * y (T, N), y[t] = sum over j in order of r_{t k + j}, summed in float32 in
 * the workspace (a2a_esmm_workspace_size bytes; 0 for choice rows or k = 1),
 * zeros for a token with no routed choice. */
A2A_API a2a_status_t a2a_esmm_workspace_size(const a2a_es_index_t* index, a2a_es_rows_t y_rows, int64_t n,
                                             a2a_dtype_t dtype, size_t* bytes);
A2A_API a2a_status_t a2a_esmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x,
                              a2a_es_rows_t x_rows, int64_t k, const void* w, a2a_es_weight_layout_t w_layout,
                              const void* bias, const void* gates, a2a_dtype_t gate_dtype, a2a_dtype_t dtype,
                              int64_t n, void* y, a2a_es_rows_t y_rows, void* workspace, size_t workspace_bytes);

/* ESS (the bias gradient): out[e] = sum over expert e's choices c, in slot
 * order, of gate_c * x[row(c)]; x (T, N) or (T * k, N), out (E, N); an
 * expert with no choice gets zeros. */
A2A_API a2a_status_t a2a_ess(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* x,
                             a2a_es_rows_t x_rows, const void* gates, a2a_dtype_t gate_dtype, a2a_dtype_t dtype,
                             int64_t n, void* out);

/* ESTMM (the weight gradient): out[e] = sum over expert e's choices c, in
 * slot order, of gate_c * a[row_a(c)]^T b[row_b(c)], an (A, B) outer product:
 * a (., A) by a_rows, b (., B) by b_rows, out (E, A, B). */
A2A_API a2a_status_t a2a_estmm(const a2a_exec_t* exec, const a2a_es_index_t* index, const void* a,
                               a2a_es_rows_t a_rows, int64_t a_dim, const void* b, a2a_es_rows_t b_rows,
                               int64_t b_dim, const void* gates, a2a_dtype_t gate_dtype, a2a_dtype_t dtype,
                               void* out);

/* The layout kernels the collectives use, for frameworks that need them
 * alone. transpose_chunks views src as a rows x cols grid of chunk_bytes
 * chunks and writes its transpose: chunk (r, c) of src lands at chunk (c, r)
 * of dst (Tutel's strideMemcpy). copy_ranges makes `count` independent copies
 * dst + ranges[i].dst_offset <- src + ranges[i].src_offset of ranges[i].bytes;
 * `ranges` is host memory. dst and src are memory of exec's device and must
 * not overlap. On CUDA both are enqueued on exec->stream. */
typedef struct {
  size_t src_offset;
  size_t dst_offset;
  size_t bytes;
} a2a_copy_range_t;
A2A_API a2a_status_t a2a_transpose_chunks(const a2a_exec_t* exec, void* dst, const void* src, size_t rows,
                                          size_t cols, size_t chunk_bytes);
A2A_API a2a_status_t a2a_copy_ranges(const a2a_exec_t* exec, void* dst, const void* src,
                                     const a2a_copy_range_t* ranges, size_t count);

/* Makes every rank of the collective fail with A2A_ERROR_REMOTE instead of
 * waiting: a binding that rejects its input before reaching the core calls
 * this in place of the collective (op: "all_to_all", "all_to_all_flex",
 * "all_to_all_v"), then reports its own error. Returns A2A_ERROR_REMOTE. */
A2A_API a2a_status_t a2a_comm_report_invalid(a2a_comm_t comm, const char* op, const char* message);

#ifdef __cplusplus
}
#endif

#endif /* A2A_A2A_H_ */
