"""Estimators for k distinct sequences drawn without replacement (grctl's stochastic beams).

The k beams of one request are a sample without replacement from the behaviour policy q (the
Gumbel top-k trick: every sequence y gets the key G_y ~ Gumbel(log q(y)), the k largest keys
are returned), so the plain mean (1/k) sum_i r(y_i) over-weights unlikely sequences: it is not
an estimate of E_q[r]. Two unbiased ones, from what each beam reports (docs/rl-integration.md):

Priority sampling (Kool, van Hoof and Welling 2019, stochastic beam search): with kappa the
(k+1)-th largest key of the search (`gumbel_threshold`), y is in the sample when G_y > kappa,
which happens with probability q_kappa(y) = 1 - exp(-exp(log q(y) - kappa)); so

    E_q[f] = E[ sum_{i in S} q(y_i) / q_kappa(y_i) f(y_i) ]            (unbiased),

and dividing by W = sum_i q(y_i) / q_kappa(y_i) instead of 1 gives the normalised estimator
(consistent, lower variance, biased for small k).

The unordered set estimator (Kool, van Hoof and Welling 2020) uses only the set's
log-probabilities: with P(S) the probability of drawing the set S in any order and P^{D\\s}
that of drawing S \\ {s} from the policy with s removed, R(S, s) = P^{D\\s}(S \\ {s}) / P(S) and

    E_q[f] = E[ sum_{s in S} q(s) R(S, s) f(s) ],

and since P(S) = sum_s q(s) P^{D\\s}(S \\ {s}) (the first draw is one of S), the weights sum to 1:
the estimate is a weighted mean of the beams' f.

Both probabilities are integrals over one uniform u (the complement's largest key is
Gumbel(log b), b = 1 - sum_{s in S} q(s)): with a_j = q(j) / b,

    P(S) = I(S),  P^{D\\s}(S \\ {s}) = I(S \\ {s}),  I(T) = int_0^1 prod_{j in T} (1 - u^{a_j}) du,

(the renormalised policies of D \\ {s} and D \\ {s, s'} give every a_j unchanged). The built-in
baseline of the policy gradient is the same estimator with s taken first:
B_s = q(s) f(s) + sum_{s' != s} q(s') I(S \\ {s, s'}) / I(S \\ {s}) f(s'), an unbiased estimate
of E_q[f] independent of which s it multiplies (k >= 2; at k = 1 there is none: B = 0), so
sum_s q(s) R(S, s) (f(s) - B_s) grad log q(s) is an unbiased gradient. I is computed in log
space by the trapezoid rule after u = exp(-e^t).
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

_LOG_HALF = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler's split at -log 2)."""
    return torch.where(x > _LOG_HALF, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _log1m_exp_neg_exp(z: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(-exp(z))): log(y) - y / 2 for y = exp(z) small, where 1 - exp(-y) rounds."""
    y = torch.exp(z)
    return torch.where(y < 1e-6, z - y / 2, torch.log(-torch.expm1(-y.clamp(min=1e-300))))


def inclusion_logprob(sampling_logprob: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """log q_kappa(y) = log(1 - exp(-exp(log q(y) - kappa))): the probability that y's key
    passes the threshold kappa; 0 (q_kappa = 1) when threshold is None (the whole support was
    drawn)."""
    phi = torch.as_tensor(sampling_logprob, dtype=torch.float64)
    if threshold is None:
        return torch.zeros_like(phi)
    return _log1m_exp_neg_exp(phi - threshold)


def priority_weights(
    sampling_logprob, threshold: float | None, *, normalize: bool = False
) -> torch.Tensor:
    """[k] weights w_i = q(y_i) / q_kappa(y_i) of a request's k beams (their
    `sampling_logprob`s and the request's `gumbel_threshold`): sum_i w_i f(y_i) estimates
    E_q[f] without bias. normalize: divide by sum_i w_i (the normalised estimator)."""
    phi = torch.as_tensor(sampling_logprob, dtype=torch.float64)
    log_w = phi - inclusion_logprob(phi, threshold)
    if normalize:
        log_w = log_w - torch.logsumexp(log_w, 0)
    return log_w.exp()


def _log_integrals(log_a: torch.Tensor, keep: torch.Tensor, step: float = 0.1) -> torch.Tensor:
    """log I(T) for each row of keep [m, k] (T: the kept columns), a_j = exp(log_a[j]).
    With u = exp(-e^t): I = int exp(t - e^t) prod_j (1 - exp(-a_j e^t)) dt over the real
    line; the integrand falls off at least as exp(t) to the left of -max log a_j and as
    exp(-e^t) to the right, so [-max(log a, 0) - 40, 4] holds all but e^-40 of it. The
    trapezoid rule on this smooth, fast-decaying integrand is accurate to float64 rounding
    at step 0.1 (tests/rl/test_estimators.py checks the set probability to 1e-8). numpy: the
    weights carry no gradient, and a few hundred points cost microseconds, not torch's
    per-op overhead."""
    la = log_a.detach().cpu().numpy().astype(np.float64)
    t = np.arange(-max(float(la.max(initial=0.0)), 0.0) - 40.0, 4.0 + step, step)
    z = la[None, :] + t[:, None]  # [N, k]
    y = np.exp(z)
    with np.errstate(divide="ignore"):
        terms = np.where(y < 1e-6, z - y / 2, np.log(-np.expm1(-np.maximum(y, 1e-300))))
    logf = (t - np.exp(t))[None, :] + keep.cpu().numpy().astype(np.float64) @ terms.T
    logf[:, [0, -1]] += math.log(0.5)
    top = logf.max(-1, keepdims=True)
    out = np.log(np.exp(logf - top).sum(-1)) + top[:, 0] + math.log(step)
    return torch.from_numpy(out)


def _log_b(log_q: torch.Tensor) -> torch.Tensor:
    """log(1 - sum q): the probability left outside the set."""
    return log1mexp(torch.logsumexp(log_q, 0).clamp(max=0.0))


def set_logprob(sampling_logprob) -> torch.Tensor:
    """log P(S): the probability that a sample without replacement of |S| draws is S, in any
    order (0 when S holds the whole support)."""
    lq = torch.as_tensor(sampling_logprob, dtype=torch.float64)
    lb = _log_b(lq)
    if not torch.isfinite(lb):
        return torch.zeros(())
    return _log_integrals(lq - lb, torch.ones(1, lq.numel(), dtype=torch.bool))[0]


def unordered_set_weights(sampling_logprob, *, whole_support: bool = False) -> torch.Tensor:
    """[k] weights w_s = q(s) R(S, s) of a set S of k distinct beams: sum_s w_s f(s) estimates
    E_q[f] without bias. whole_support (the request's gumbel_threshold is null, or the
    sampling_logprobs sum to 1): R = 1, the estimate is the exact sum_s q(s) f(s)."""
    lq = torch.as_tensor(sampling_logprob, dtype=torch.float64)
    lb = _log_b(lq)
    if whole_support or not torch.isfinite(lb):
        return lq.exp()
    k = lq.numel()
    keep = ~torch.eye(k, dtype=torch.bool)  # S \\ {s}, one row per s
    rows = torch.cat((torch.ones(1, k, dtype=torch.bool), keep))
    logs = _log_integrals(lq - lb, rows)
    return (lq + logs[1:] - logs[0]).exp()


def unordered_set_baselines(
    sampling_logprob, rewards, *, whole_support: bool = False
) -> torch.Tensor:
    """[k] the built-in baselines B_s (module docstring): B_s = q(s) f(s) + sum_{s' != s}
    q(s') I(S \\ {s, s'}) / I(S \\ {s}) f(s')."""
    lq = torch.as_tensor(sampling_logprob, dtype=torch.float64)
    f = torch.as_tensor(rewards, dtype=torch.float64)
    k = lq.numel()
    lb = _log_b(lq)
    if whole_support or not torch.isfinite(lb):
        return (lq.exp() * f).sum().expand(k).clone()
    if k == 1:  # no other beam to estimate the rest with: no baseline (plain REINFORCE)
        return torch.zeros(1, dtype=torch.float64)
    eye = torch.eye(k, dtype=torch.bool)
    one_out = ~eye  # row s: S \\ {s}
    two_out = ~(eye[:, None, :] | eye[None, :, :])  # [s, s', j]: S \\ {s, s'}
    logs = _log_integrals(lq - lb, torch.cat((one_out, two_out.reshape(k * k, k))))
    log_one, log_two = logs[:k], logs[k:].reshape(k, k)
    ratio = (lq[None, :] + log_two - log_one[:, None]).exp()  # [s, s']: q(s') I(..) / I(..)
    ratio = ratio.masked_fill(eye, 0.0)
    return lq.exp() * f + ratio @ f


def unordered_set_advantages(
    sampling_logprob, rewards, *, whole_support: bool = False
) -> torch.Tensor:
    """[k] the coefficients c_s = q(s) R(S, s) (f(s) - B_s) of grad log pi(s) in the unordered
    set policy gradient with its built-in baseline: loss = -sum_s c_s log pi(s) (c detached)."""
    w = unordered_set_weights(sampling_logprob, whole_support=whole_support)
    b = unordered_set_baselines(sampling_logprob, rewards, whole_support=whole_support)
    return w * (torch.as_tensor(rewards, dtype=torch.float64) - b)


def whole_support_of(meta_info) -> bool:
    """`whole_support` for one stochastic-beam reply, from its meta_info (the JSON dict, or the
    client's struct): True when gumbel_threshold is null (every sequence of the support was
    drawn: the estimate is exact), False when it is a key. An aborted reply (finish_reason
    abort; its gumbel_threshold is absent) is no sample without replacement of anything: its
    beams are partial, and no estimator weights them: ValueError (resubmit the request)."""
    get = meta_info.get if isinstance(meta_info, dict) else lambda k: getattr(meta_info, k, None)
    finish = get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else getattr(finish, "type", None)
    threshold = get("gumbel_threshold")
    absent = isinstance(meta_info, dict) and "gumbel_threshold" not in meta_info
    if kind == "abort" or absent or threshold is msgspec.UNSET:
        raise ValueError(
            "an aborted reply (finish_reason abort, no gumbel_threshold) has no estimator: "
            "resubmit it"
        )
    return threshold is None
