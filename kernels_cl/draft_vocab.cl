// Draft logits over a reduced vocabulary (Eagle3's d2t) laid out over the target's: y[r, t] =
// x[r, draft_of[t]] where a draft id maps to target id t, -inf elsewhere (never sampled, never
// accepted), so everything downstream sees target ids. CPU shape: dimension 0 is the row,
// dimension 1 a chunk of CHUNK target ids.
#define CHUNK 256

kernel void draft_to_target_vocab(global const float* x, uint vd, global const int* draft_of,
                                  global float* y, uint vt) {
  const uint r = get_global_id(0);
  const uint t0 = get_global_id(1) * CHUNK;
  const uint t1 = min(t0 + CHUNK, vt);
  global const float* src = x + (size_t)r * vd;
  global float* dst = y + (size_t)r * vt;
  for (uint t = t0; t < t1; ++t) {
    const int d = draft_of[t];
    dst[t] = d >= 0 ? src[d] : -INFINITY;
  }
}

// The GPU shape: a work-item per target id (dimension 0, rounded up to the work-group) and row
// (dimension 1), so neighbouring lanes read neighbouring draft_of entries and write neighbouring
// logits.
kernel void draft_to_target_vocab_wg(global const float* x, uint vd, global const int* draft_of,
                                     global float* y, uint vt) {
  const uint t = get_global_id(0), r = get_global_id(1);
  if (t >= vt) return;
  const int d = draft_of[t];
  y[(size_t)r * vt + t] = d >= 0 ? x[(size_t)r * vd + d] : -INFINITY;
}
