/* A router's step through liba2a's C ABI, no MPI: the fused top-k gate
 * (a2a_top_k_gate) on a few tokens' logits, then its backward
 * (a2a_top_k_gate_backward) checked against central differences of the loss
 * L = sum(gates * w) + 0.5 * l_aux, and a bad argument's error. Prints
 * #wrong; exits 1 on any.
 *
 *   ./top_k_gate */
#include <a2a/a2a.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    a2a_status_t status_ = (call);                                                                  \
    if (status_ != A2A_SUCCESS) {                                                                   \
      fprintf(stderr, "%s failed (%s): %s\n", #call, a2a_status_string(status_), a2a_get_last_error()); \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)

enum { T = 6, E = 5, K = 2 };

static const double kLossWeight = 0.5;

/* The loss of logits x, through the forward alone; the gates' weights w. */
static double loss_of(const a2a_exec_t* exec, const a2a_top_k_gate_t* gate, const double* x, const double* w,
                      void* workspace) {
  double scores[T * E], gates[T * K], share[E], l_aux;
  int64_t indices[T * K];
  CHECK(a2a_top_k_gate(exec, gate, x, scores, indices, gates, share, &l_aux, workspace));
  double loss = kLossWeight * l_aux;
  for (int i = 0; i < T * K; ++i) loss += gates[i] * w[i];
  return loss;
}

int main(void) {
  a2a_exec_t exec = A2A_EXEC_CPU_INIT;
  a2a_top_k_gate_t gate = {T, E, K, 1, A2A_FLOAT64};
  size_t workspace_bytes = 0;
  CHECK(a2a_top_k_gate_workspace_size(&gate, &workspace_bytes));
  double* workspace = malloc(workspace_bytes);
  double x[T * E], w[T * K];
  for (int i = 0; i < T * E; ++i) x[i] = sin(1.7 * i) * 2.0; /* no two equal: the choices are stable */
  for (int i = 0; i < T * K; ++i) w[i] = cos(0.9 * i);

  double scores[T * E], gates[T * K], share[E], l_aux, d_logits[T * E];
  int64_t indices[T * K];
  CHECK(a2a_top_k_gate(&exec, &gate, x, scores, indices, gates, share, &l_aux, workspace));
  int wrong = 0;
  for (int t = 0; t < T; ++t) {  /* choices best first, normalized gates */
    wrong += !(scores[t * E + indices[t * K]] >= scores[t * E + indices[t * K + 1]]);
    wrong += fabs(gates[t * K] + gates[t * K + 1] - 1.0) > 1e-15;
  }

  const double d_l_aux = kLossWeight;
  CHECK(a2a_top_k_gate_backward(&exec, &gate, scores, indices, share, w, &d_l_aux, d_logits));
  double largest_error = 0;
  for (int i = 0; i < T * E; ++i) {  /* central differences; the share is piecewise constant */
    const double h = 1e-6, saved = x[i];
    x[i] = saved + h;
    const double up = loss_of(&exec, &gate, x, w, workspace);
    x[i] = saved - h;
    const double down = loss_of(&exec, &gate, x, w, workspace);
    x[i] = saved;
    const double error = fabs((up - down) / (2 * h) - d_logits[i]);
    largest_error = error > largest_error ? error : largest_error;
    wrong += error > 1e-7;
  }

  /* k above E: an error that says so, nothing written. */
  a2a_top_k_gate_t bad = gate;
  bad.top_k = E + 1;
  const a2a_status_t status = a2a_top_k_gate(&exec, &bad, x, scores, indices, gates, share, &l_aux, workspace);
  wrong += status != A2A_ERROR_INVALID_ARGUMENT;
  printf("top_k_gate: %d tokens, %d experts, top-%d, l_aux %.6f, largest |d_logits - central difference| %.2e\n",
         T, E, K, l_aux, largest_error);
  printf("top_k_gate: k = %d refused: %s\n", E + 1, a2a_get_last_error());
  printf("# wrong %d\n", wrong);
  free(workspace);
  return wrong == 0 ? 0 : 1;
}
