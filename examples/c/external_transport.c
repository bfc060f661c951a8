/* A communicator over your own transport (a2a_comm_create_external): here
 * four threads of one process, whose messages go through a mailbox in
 * memory. Any channel that can post a message to a peer and wait for it
 * serves the same way (a framework's own process group, a job launcher's
 * sockets). Every algorithm runs over it; the program checks an
 * all-to-all (linear and 2DH over 2 x 2 emulated nodes), an all-reduce, a
 * split, and that a rank that never calls ends its peers' wait with
 * A2A_ERROR_TIMEOUT; and what a2a_comm_create_nccl_with_control (the same
 * ops beside NCCL) refuses before NCCL. No MPI; run it directly:
 *
 *   ./external_transport
 *
 * Prints one line per check with its #wrong count and exits non-zero if
 * anything is wrong. */
#include <a2a/a2a.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RANKS 4
#define MAX_REQUESTS 256

/* ---- The transport: a mailbox of messages, matched by (source, destination, tag) in posting order. */

typedef struct message {
  int src, dst, tag;
  size_t bytes;
  struct message* next;
  char data[];
} message_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t arrived = PTHREAD_COND_INITIALIZER;
static message_t* first = NULL;
static message_t** last = &first;

typedef struct {
  void* data;
  size_t bytes;
  int peer, tag, done;
} request_t;

typedef struct {
  int rank;
  request_t requests[MAX_REQUESTS]; /* the receives of this rank's open call */
  int count;
} endpoint_t;

/* A send is a copy into the mailbox: complete at once. */
static int mailbox_isend(void* user, const void* data, size_t bytes, int peer, int tag, int64_t* request, char* error,
                         size_t error_size) {
  (void)error;
  (void)error_size;
  endpoint_t* me = user;
  message_t* m = malloc(sizeof(message_t) + bytes);
  m->src = me->rank, m->dst = peer, m->tag = tag, m->bytes = bytes, m->next = NULL;
  memcpy(m->data, data, bytes);
  pthread_mutex_lock(&lock);
  *last = m;
  last = &m->next;
  pthread_cond_broadcast(&arrived);
  pthread_mutex_unlock(&lock);
  *request = -1; /* nothing to wait for */
  return A2A_SUCCESS;
}

static int mailbox_irecv(void* user, void* data, size_t bytes, int peer, int tag, int64_t* request, char* error,
                         size_t error_size) {
  endpoint_t* me = user;
  if (me->count == MAX_REQUESTS) {
    snprintf(error, error_size, "more than %d receives in one call", MAX_REQUESTS);
    return A2A_ERROR_TRANSPORT;
  }
  me->requests[me->count] = (request_t){data, bytes, peer, tag, 0};
  *request = me->count++;
  return A2A_SUCCESS;
}

/* Takes the first message for `r` out of the mailbox, if it came (lock held). */
static int take(endpoint_t* me, request_t* r, char* error, size_t error_size) {
  for (message_t** at = &first; *at != NULL; at = &(*at)->next) {
    message_t* m = *at;
    if (m->src != r->peer || m->dst != me->rank || m->tag != r->tag) continue;
    if (m->bytes != r->bytes) {
      snprintf(error, error_size, "rank %d sent %zu bytes where rank %d receives %zu", m->src, m->bytes, me->rank,
               r->bytes);
      return -1;
    }
    memcpy(r->data, m->data, m->bytes);
    *at = m->next;
    if (last == &m->next) last = at;
    free(m);
    r->done = 1;
    return 1;
  }
  return 0;
}

static int mailbox_wait(void* user, const int64_t* requests, size_t count, double timeout_s, char* error,
                        size_t error_size) {
  endpoint_t* me = user;
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += (time_t)timeout_s;
  deadline.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec += 1, deadline.tv_nsec -= 1000000000L;
  int status = A2A_SUCCESS;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < count && status == A2A_SUCCESS; ++i) {
    if (requests[i] < 0) continue; /* a send */
    request_t* r = &me->requests[requests[i]];
    int got;
    while ((got = take(me, r, error, error_size)) == 0) {
      if (pthread_cond_timedwait(&arrived, &lock, &deadline) == ETIMEDOUT && take(me, r, error, error_size) == 0) {
        snprintf(error, error_size, "no message from rank %d within %g s", r->peer, timeout_s);
        got = -2;
        break;
      }
    }
    if (got < 0) status = got == -2 ? A2A_ERROR_TIMEOUT : A2A_ERROR_TRANSPORT;
  }
  pthread_mutex_unlock(&lock);
  me->count = 0; /* the call's receives are over, done or abandoned */
  return status;
}

/* ---- The ranks. */

static int wrong_total = 0;
static pthread_mutex_t report = PTHREAD_MUTEX_INITIALIZER;

static void check(int rank, const char* what, int wrong) {
  pthread_mutex_lock(&report);
  if (rank == 0 || wrong) printf("rank %d: %-40s #wrong %d\n", rank, what, wrong);
  wrong_total += wrong;
  pthread_mutex_unlock(&report);
}

#define CHECK(rank, call)                                                                                   \
  do {                                                                                                      \
    a2a_status_t status_ = (call);                                                                          \
    if (status_ != A2A_SUCCESS) {                                                                           \
      fprintf(stderr, "rank %d: %s failed (%s): %s\n", rank, #call, a2a_status_string(status_),             \
              a2a_get_last_error());                                                                        \
      exit(1);                                                                                              \
    }                                                                                                       \
  } while (0)

static void* run_rank(void* arg) {
  endpoint_t* me = arg;
  const int rank = me->rank;
  a2a_transport_ops_t ops = {sizeof(a2a_transport_ops_t), "mailbox", me, mailbox_isend, mailbox_irecv,
                             mailbox_wait, NULL};
  a2a_comm_config_t config = A2A_COMM_CONFIG_INIT;
  config.local_size = 2; /* 2 x 2 emulated nodes: 2DH has two phases */
  config.timeout_s = 2;
  a2a_comm_t comm;
  CHECK(rank, a2a_comm_create_external(&ops, RANKS, rank, &config, &comm));

  enum { COUNT = 1001 }; /* per peer: odd on purpose */
  float* send = malloc(sizeof(float) * COUNT * RANKS);
  float* recv = malloc(sizeof(float) * COUNT * RANKS);
  for (int dst = 0; dst < RANKS; ++dst)
    for (int i = 0; i < COUNT; ++i) send[dst * COUNT + i] = (float)(rank * 1000 + dst * 10 + i % 7);
  const a2a_algo_t algos[2] = {A2A_ALGO_LINEAR, A2A_ALGO_2DH};
  for (int a = 0; a < 2; ++a) {
    memset(recv, 0, sizeof(float) * COUNT * RANKS);
    size_t workspace_bytes = 0;
    CHECK(rank, a2a_all_to_all_workspace_size(comm, COUNT, A2A_FLOAT32, algos[a], &workspace_bytes));
    void* workspace = workspace_bytes ? malloc(workspace_bytes) : NULL;
    CHECK(rank, a2a_all_to_all(comm, send, recv, COUNT, A2A_FLOAT32, algos[a], workspace, workspace_bytes));
    free(workspace);
    int wrong = 0;
    for (int src = 0; src < RANKS; ++src)
      for (int i = 0; i < COUNT; ++i) wrong += recv[src * COUNT + i] != (float)(src * 1000 + rank * 10 + i % 7);
    check(rank, a ? "all_to_all, 2dh" : "all_to_all, linear", wrong);
  }

  double sums[7];
  for (int i = 0; i < 7; ++i) sums[i] = rank + i;
  CHECK(rank, a2a_all_reduce(comm, sums, sums, 7, A2A_FLOAT64, A2A_SUM));
  int wrong = 0;
  for (int i = 0; i < 7; ++i) wrong += sums[i] != 6.0 + 4.0 * i; /* 0 + 1 + 2 + 3, plus i on each rank */
  check(rank, "all_reduce, 7 float64 in place", wrong);

  a2a_comm_t half;
  CHECK(rank, a2a_comm_split(comm, rank % 2, rank, &half));
  int half_rank, half_size;
  CHECK(rank, a2a_comm_topology(half, &half_rank, &half_size, NULL, NULL, NULL, NULL));
  int64_t mine = rank, gathered[2] = {-1, -1};
  CHECK(rank, a2a_all_gather(half, &mine, gathered, 1, A2A_INT64));
  check(rank, "split by parity, all_gather", (half_size != 2) + (gathered[0] != rank % 2) + (gathered[1] != rank % 2 + 2));
  CHECK(rank, a2a_comm_destroy(half));

  /* Rank 3 never makes this call: the others' wait ends at the timeout, not in a hang. */
  if (rank != 3) {
    a2a_status_t status = a2a_all_to_all(comm, send, recv, COUNT, A2A_FLOAT32, A2A_ALGO_LINEAR, NULL, 0);
    check(rank, "a call rank 3 never makes: A2A_ERROR_TIMEOUT", status != A2A_ERROR_TIMEOUT);
  }
  CHECK(rank, a2a_comm_destroy(comm));
  free(send);
  free(recv);
  return NULL;
}

/* The same ops can stand beside NCCL (a2a_comm_create_nccl_with_control), carrying a CUDA
 * communicator's check and host values. Without a GPU, what it refuses before NCCL is reached: a
 * NULL id fails with A2A_ERROR_INVALID_ARGUMENT, and the ops are released, as on any failure. */
static int released = 0;
static void count_release(void* user) {
  (void)user;
  ++released;
}

static int nccl_with_control_refusals(void) {
  static endpoint_t solo = {0};
  a2a_transport_ops_t ops = {sizeof(a2a_transport_ops_t), "mailbox", &solo, mailbox_isend, mailbox_irecv,
                             mailbox_wait, count_release};
  a2a_comm_t comm = NULL;
  const a2a_status_t no_id = a2a_comm_create_nccl_with_control(NULL, 1, 0, &ops, NULL, &comm);
  const a2a_status_t no_ops = a2a_comm_create_nccl_with_control(NULL, 1, 0, NULL, NULL, &comm);
  const int wrong = (no_id != A2A_ERROR_INVALID_ARGUMENT) + (released != 1) + (no_ops != A2A_ERROR_INVALID_ARGUMENT);
  printf("a2a_comm_create_nccl_with_control refusals    #wrong %d\n", wrong);
  return wrong;
}

int main(void) {
  static endpoint_t endpoints[RANKS];
  pthread_t threads[RANKS];
  for (int r = 0; r < RANKS; ++r) {
    endpoints[r].rank = r;
    pthread_create(&threads[r], NULL, run_rank, &endpoints[r]);
  }
  for (int r = 0; r < RANKS; ++r) pthread_join(threads[r], NULL);
  wrong_total += nccl_with_control_refusals();
  printf("%s: #wrong %d\n", wrong_total ? "FAIL" : "OK", wrong_total);
  return wrong_total ? 1 : 0;
}
