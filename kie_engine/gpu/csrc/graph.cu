/* graph.cu - a decode step by the engine's kernel (per-sublayer launches or the
 * monokernel), and the step captured once per mode as a CUDA graph. */
#include "engine_internal.h"

namespace kie_host {

/* One decode step, by the engine's kernel. */
int enqueue_step(kie_engine *e, int mode) {
  return e->s.kernel == KIE_KERNEL_MONO ? enqueue_mono(e, mode) : enqueue_forward(e, 1, mode);
}

int capture(kie_engine *e, int mode) {
  if (e->graph[mode]) return KIE_OK;
  if (e->s.kernel == KIE_KERNEL_MONO) TRY(mono_prepare(e)); /* uploads: not inside a capture */
  return capture_graph(e, [&] { return enqueue_step(e, mode); }, &e->graph[mode], &e->graph_nodes);
}

}  // namespace kie_host
