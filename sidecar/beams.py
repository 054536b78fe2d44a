"""Beam search bookkeeping for one prompt, with transformers' semantics (`generate(num_beams=...)`).

Pure tensors, no model: each step takes the processed log-probabilities of the running beams and
returns which running beam each new beam continues (the index the cache and the processor states
follow) and the token it appends. The rules are transformers' own, so sequences and scores match
`model.generate(num_beams=..., do_sample=False)`:

- the running beams start as copies of the prompt, all but the first with score -1e9, so the first
  step expands one beam;
- each step keeps the best `max(2, 1 + number of EOS ids) * num_beams` continuations (all there are, when
  the EOS ids are most of a tiny vocabulary, where transformers' `topk` fails); those ending in
  EOS (or reaching `max_new_tokens`) are finished hypotheses scored `sum of log-probs / length **
  length_penalty` (length counts generated tokens), and only those among the top `num_beams` may enter
  the finished set; the best `num_beams` others keep running;
- `early_stopping`: True stops once `num_beams` hypotheses are finished; False stops when the best
  running beam, scored at its current length, cannot beat the worst finished one; "never" scores it at
  the longest possible length when `length_penalty` > 0.

`length ** length_penalty` is computed as transformers computes it (a Python int raised to a float),
except that a power too large for a float, which Python raises OverflowError for (transformers
itself fails there, e.g. `length_penalty` 1000.0 from the third token), is taken as inf: a score
divided by it is 0 with the score's sign, the limit of the formula, as 250.0 already gives through
float32. A reported score is always finite (`finite`).

With `logprobs` k, each token also has a record (`logprobs.records`). A step keeps those of the beams it
leaves running and of the hypotheses it finishes, each with the running beam of the step before that
it continues, and a sequence's records are read back along those links at the end: nothing is copied
as beams reorder, and a step holds at most 2 x num_beams records however many candidates it weighs.
"""

from __future__ import annotations

import math

import torch

from . import logprobs

DEAD = -1.0e9


def length_power(length: int, length_penalty: float) -> float:
    """`length ** length_penalty`, the divisor of a hypothesis' summed log-probs; inf where the power
    overflows a float (the value transformers' formula tends to), bit-identical to it elsewhere."""
    try:
        return length ** length_penalty
    except OverflowError:
        return math.inf


def finite(score: float) -> float:
    """A score a reply can carry: where transformers' formula is not finite (a sum of log-probs of 0 or
    above divided by a power that underflowed to 0), DEAD with its sign, and NaN (0 / 0) as 0, its limit."""
    if math.isnan(score):
        return 0.0
    return score if math.isfinite(score) else math.copysign(-DEAD, score)


def normalised(score: float, length: int, length_penalty: float) -> float:
    """A running beam's `score / length ** length_penalty` as a Python float, as `finite` makes it: a
    power that underflows to 0 (a hugely negative `length_penalty`) would make it -inf (Python raises
    ZeroDivisionError for it), -1e9 here, the floor below which no hypothesis enters the finished set."""
    power = length_power(length, length_penalty)
    return finite(score / power if power else score * math.inf)


class BeamSearch:
    def __init__(self, num_beams: int, max_new_tokens: int, eos_token_ids, length_penalty: float,
                 early_stopping, vocab_size: int, device, logprobs: int | None = None):
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
        self.keep = min(max(2, 1 + len(eos_token_ids)) * num_beams, num_beams * vocab_size)
        self.top_beams = torch.arange(self.keep, device=device) < num_beams
        self.step_count = 0  # tokens generated so far by every running beam
        self.running = torch.zeros(num_beams, max_new_tokens, dtype=torch.long, device=device)
        self.running_scores = torch.full((num_beams,), DEAD, dtype=torch.float32, device=device)
        self.running_scores[0] = 0.0
        self.finished = torch.zeros(num_beams, max_new_tokens, dtype=torch.long, device=device)
        self.finished_scores = torch.full((num_beams,), DEAD, dtype=torch.float32, device=device)
        self.finished_lengths = torch.zeros(num_beams, dtype=torch.long, device=device)
        self.is_finished = torch.zeros(num_beams, dtype=torch.bool, device=device)
        self.all_finished = False  # `is_finished.all()`, read on the host once a step
        self.in_order = torch.arange(num_beams, device=device)  # the finished set's slots, unchanged
        self.improvable = True
        self.done = False
        self.logprobs = logprobs
        self.trail: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's (running beams' records, their parents)
        self.finished_records: torch.Tensor | None = None  # each finished hypothesis' last token's record
        self.finished_parents = torch.zeros(num_beams, dtype=torch.long, device=device)
        self._candidates = None  # this step's (model log-probs, their top k, each candidate's source and token)

    def step(self, log_probs: torch.Tensor, model_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes [num_beams, vocab] processed log-probs (and with `logprobs`, the model's own); returns (source
        beam per new beam, its new token)."""
        vocab = log_probs.shape[-1]
        total = (log_probs + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = total.topk(self.keep)
        source, tokens = top_index // vocab, top_index % vocab
        if self.logprobs is not None:
            self._candidates = (model_log_probs, logprobs.top_of(model_log_probs, self.logprobs), source, tokens)
        step = self.step_count
        candidates = self.running.index_select(0, source)
        candidates[:, step] = tokens
        ends = torch.isin(tokens, self.eos) if self.eos.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        if step + 1 >= self.max_new_tokens:
            ends = torch.ones_like(ends)

        # The best num_beams continuations that did not end keep running.
        alive_scores = torch.where(ends, top_scores + DEAD, top_scores)
        keep = alive_scores.topk(self.num_beams).indices
        self.running = candidates.index_select(0, keep)
        self.running_scores = alive_scores.index_select(0, keep)
        beam_index, beam_tokens = source.index_select(0, keep), tokens.index_select(0, keep)
        if self._candidates is not None:
            self.trail.append((self._records(keep), beam_index))

        self._finish_hypotheses(candidates, top_scores, ends, step + 1)
        self.step_count = step + 1
        self._update_improvable()
        self.done = not (self.improvable and not (self.all_finished and self.early_stopping is True)
                         and not bool(ends.all()))
        return beam_index, beam_tokens

    def _finish_hypotheses(self, candidates, top_scores, ends, length: int) -> None:
        just_finished = ends & self.top_beams
        scores = top_scores / length_power(length, self.length_penalty)
        if self.all_finished and self.early_stopping is True:
            scores = scores + DEAD
        if not self.improvable:
            scores = scores + DEAD
        scores = torch.where(just_finished, scores, scores + DEAD)
        merged_scores = torch.cat([self.finished_scores, scores])
        best = merged_scores.topk(self.num_beams).indices
        if torch.equal(best, self.in_order):  # no candidate entered: the finished set stays as it is
            return
        lengths = torch.full((len(scores),), length, dtype=torch.long, device=scores.device)
        if self._candidates is not None:  # the records of the candidates that entered, the others' kept
            entered, kept = best >= self.num_beams, best.clamp(max=self.num_beams - 1)
            candidate = (best - self.num_beams).clamp(min=0)
            found = self._records(candidate)
            before = self.finished_records if self.finished_records is not None else torch.zeros_like(found)
            self.finished_records = torch.where(entered[:, None], found, before.index_select(0, kept))
            self.finished_parents = torch.where(entered, self._candidates[2].index_select(0, candidate),
                                                self.finished_parents.index_select(0, kept))
        self.finished = torch.cat([self.finished, candidates]).index_select(0, best)
        self.finished_scores = merged_scores.index_select(0, best)
        self.finished_lengths = torch.cat([self.finished_lengths, lengths]).index_select(0, best)
        self.is_finished = torch.cat([self.is_finished, just_finished]).index_select(0, best)
        self.all_finished = bool(self.is_finished.all())

    def _update_improvable(self) -> None:
        """Whether the best running beam can still beat a finished slot: an open slot (counted as DEAD)
        or the worst finished hypothesis. Compared on the host, as float32 values, once a step."""
        if not self.improvable:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.step_count
        best_running = float(self.running_scores[0] / length_power(best_length, self.length_penalty))
        finished = self.is_finished.tolist()
        self.improvable = ((not all(finished) and best_running > DEAD)
                           or (any(finished) and best_running > float(self.finished_scores.min())))

    def _records(self, index: torch.Tensor) -> torch.Tensor:
        """`logprobs.records` of this step's candidates `index`: each token's model log-probability, and the
        top k of the beam it continues."""
        model_log_probs, top, source, tokens = self._candidates
        return logprobs.records(model_log_probs, tokens.index_select(0, index), top, source.index_select(0, index))

    def _trace(self, last: torch.Tensor | None, parent: int, length: int) -> list[float] | None:
        """The records of a sequence of `length` tokens whose last token's record is `last`, continuing the
        running beam `parent` of the step before, read back along the trail, one after another (None without
        `logprobs`)."""
        if self.logprobs is None or not length:
            return None if self.logprobs is None else []
        found = [last]
        for step in range(length - 2, -1, -1):
            records, parents = self.trail[step]
            found.append(records[parent])
            parent = int(parents[parent])
        return torch.stack(found[::-1]).reshape(-1).tolist()

    def results(self, count: int) -> list[tuple[list[int], float, list[float] | None]]:
        """The best `count` finished hypotheses, best first: (generated tokens, score, their records)."""
        found = []
        for i in range(count):
            length = int(self.finished_lengths[i])
            last = self.finished_records[i] if self.finished_records is not None else None
            found.append((self.finished[i, :length].tolist(), finite(float(self.finished_scores[i])),
                          self._trace(last, int(self.finished_parents[i]), length)))
        return found

    def running_results(self, count: int) -> list[tuple[list[int], float, list[float] | None]]:
        """The best `count` running beams as they stand (a search cancelled part-way), best first, scored
        like finished ones at their current length."""
        length = max(self.step_count, 1)
        records, parents = self.trail[-1] if self.trail else (None, None)
        return [(self.running[i, : self.step_count].tolist(),
                 normalised(float(self.running_scores[i]), length, self.length_penalty),
                 self._trace(records[i] if self.trail else None, int(parents[i]) if self.trail else 0, self.step_count))
                for i in range(count)]
