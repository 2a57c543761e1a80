/* Fused CPU kernel for the Optimal Token Baseline estimators (dense OTB and TIR-OTB), float32.
 *
 * The plain PyTorch estimators in otb_tir/advantage.py are the reference; this file computes the
 * same numbers in the same floating-point order (float32 products, double-accumulated cumulative
 * sums stored as float32 as torch.cumsum does on CPU, float32 group sums in ascending row order,
 * float32 division), but group by group: a group's rows are a few hundred KB, so after the first
 * read they are served from cache, and each input is read from memory about once.
 *
 * Compiled on first use by otb_tir/fused.py with -O3 -ffp-contract=off (no fused multiply-add:
 * every operation rounds as torch's separate elementwise kernels do). No torch headers.
 *
 * Per group g (rows order[offsets[g] .. offsets[g+1]), ascending row index):
 *   1. each row: G_t = sum_{j>=t} r_j*m_j (reverse pass into ret), then the forward pass
 *      W_t = sum_{j<=t} (1 - 2*pi_j + sp2_j)*rho_j^2*m_j, and the group sums keyed on the slot of
 *      token t: num[slot] += (W_t*m_t)*G_t, den[slot] += W_t*m_t.
 *      TIR: slot = running count of policy tokens (m != 0); dense: slot = column t.
 *   2. table[slot] = num / (den + eps), 0 for groups of fewer than 2 members; handle_zero_tail.
 *   3. each row: adv_t = (G_t - table[slot_t]) * m_t.
 * `pi` holds exp(old_log_probs) on entry (computed by torch.exp, bit-identical to verl's) and
 * is the advantages buffer on exit: each element is read before it is overwritten.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int otb_fused_abi_version(void) { return 1; }

/* Returns 0 on success, 1 if a table buffer could not be allocated. */
int otb_fused_f32(const float *rewards, const float *mask, float *pi_adv, const float *sp2, const float *rho,
                  float *ret, const int64_t *order, const int64_t *offsets, int64_t group_begin,
                  int64_t group_end, int64_t resp, int tir, int handle_zero_tail, float eps) {
    const int64_t slots = tir ? resp + 1 : resp;
    float *num = (float *)malloc(sizeof(float) * (size_t)(slots > 0 ? slots : 1));
    float *den = (float *)malloc(sizeof(float) * (size_t)(slots > 0 ? slots : 1));
    if (!num || !den) {
        free(num);
        free(den);
        return 1;
    }
    for (int64_t g = group_begin; g < group_end; g++) {
        const int64_t first = offsets[g], last = offsets[g + 1];
        int64_t used = 0;     /* slots touched by the group: 0..used-1 */
        int64_t members = 0;  /* TIR: rows with a policy token; dense: all rows */
        int64_t longest = -1, n_longest = 0, runner_up = -1, tail_row = -1;
        memset(num, 0, sizeof(float) * (size_t)slots);
        memset(den, 0, sizeof(float) * (size_t)slots);
        for (int64_t i = first; i < last; i++) {
            const int64_t b = order[i];
            const float *r = rewards + b * resp, *m = mask + b * resp, *p = pi_adv + b * resp;
            const float *s = sp2 + b * resp, *q = rho ? rho + b * resp : 0;
            float *G = ret + b * resp;
            double acc = 0.0;
            for (int64_t t = resp - 1; t >= 0; t--) {
                acc += (double)(r[t] * m[t]);
                G[t] = (float)acc;
            }
            double accw = 0.0;
            double msum = 0.0;
            int64_t count = 0;
            for (int64_t t = 0; t < resp; t++) {
                float w = (1.0f - 2.0f * p[t]) + s[t];
                if (q) w = w * (q[t] * q[t]);
                accw += (double)(w * m[t]);
                const float Wm = (float)accw * m[t];
                int64_t slot;
                if (tir) {
                    count += m[t] != 0.0f;
                    slot = count;
                } else {
                    msum += (double)m[t];
                    slot = t;
                }
                den[slot] += Wm;
                num[slot] += Wm * G[t];
            }
            /* A row's length in policy tokens: TIR counts them, dense sums the mask (as verl). */
            const int64_t length = tir ? count : (int64_t)msum;
            if (tir) {
                if (count + 1 > used) used = count + 1;
                members += count > 0;
            } else {
                used = resp;
                members += 1;
            }
            if (length > longest) {
                if (longest >= 0) runner_up = longest > runner_up ? longest : runner_up;
                longest = length;
                n_longest = 1;
                tail_row = b;
            } else if (length == longest) {
                n_longest += 1;
            } else if (length > runner_up) {
                runner_up = length;
            }
        }
        /* Table of baselines (in num). */
        if (members < 2) {
            memset(num, 0, sizeof(float) * (size_t)used);
        } else {
            for (int64_t k = 0; k < used; k++) num[k] = num[k] / (den[k] + eps);
        }
        /* handle_zero_tail: the group's unique longest row, beyond the runner-up length. */
        int64_t zero_row = -1, zero_from = resp + 1;
        if (handle_zero_tail && members >= 2 && n_longest == 1) {
            const int64_t start = runner_up > 0 ? runner_up : 0;
            if (tir) {
                /* Beyond the runner-up only this row has policy tokens: zero the table's slots
                 * k + 1 for k >= runner-up. */
                for (int64_t k = start + 1; k < used; k++) num[k] = 0.0f;
            } else {
                zero_row = tail_row;
                zero_from = start;
            }
        }
        for (int64_t i = first; i < last; i++) {
            const int64_t b = order[i];
            const float *m = mask + b * resp, *G = ret + b * resp;
            float *A = pi_adv + b * resp;
            if (tir) {
                int64_t count = 0;
                for (int64_t t = 0; t < resp; t++) {
                    count += m[t] != 0.0f;
                    A[t] = (G[t] - num[count]) * m[t];
                }
            } else {
                const int64_t stop = b == zero_row ? zero_from : resp;
                for (int64_t t = 0; t < stop; t++) A[t] = (G[t] - num[t]) * m[t];
                for (int64_t t = stop; t < resp; t++) A[t] = (G[t] - 0.0f) * m[t];
            }
        }
    }
    free(num);
    free(den);
    return 0;
}
