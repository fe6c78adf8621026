"""n > 1 and best_of: the choices of one API request, each its own engine request and
`Exchange`, answered as one response.

Rules:
1. Choice i is engine request `request_ids[i]` with params `choice_params(params, k)[i]`
   (core/sampling_params.py: seed + i), submitted together by `EngineCore.add_choices`,
   which shares the prompt's KV blocks among them.
2. Streaming: every choice's chunks carry its `index` and go out as the engine makes them,
   interleaved (as OpenAI streams n > 1). The response HEADERS go out with the first token of
   any choice; each choice that ends sends its own finish chunk, and the last one to end
   also sends the usage chunk (when asked), `[DONE]` and the trailers.
3. Whole responses: each choice's text, ids and logprobs wait in the group; the last one to
   end writes one body with every choice, by index. With best_of > n, the n choices with the
   highest mean token log-probability are returned, best first, re-indexed from 0.
4. Usage counts the prompt once and every sampled completion (best_of: all of them);
   `cached_tokens` is the first choice's (the others reuse what it computed).
5. The stream maps to the first choice's request id (`proto.requests`); cancelling the stream
   cancels every choice still running.
"""

from ...core.outputs import FINISH_ERROR

from . import encoders


class ChoiceGroup:
    """The state shared by the exchanges of one n > 1 request."""
    __slots__ = ("members", "n", "num_running", "num_output_tokens", "num_cached_tokens", "results",
                 "scores", "opened", "timeline", "error")

    def __init__(self, n: int):
        self.members = []                   # list[Exchange], by choice index
        self.n = n                          # choices returned (best_of: the members sampled)
        self.num_running = 0                # members not ended
        self.num_output_tokens = 0          # summed over the ended members
        self.num_cached_tokens = 0          # the first choice's
        self.results = {}                   # index -> (text, token_ids, logprobs, finish_reason): whole responses
        self.scores = {}                    # index -> summed token log-probability (best_of)
        self.opened = False                 # the response HEADERS went out
        self.timeline = None                # the timeline of the choice whose token opened the stream
        self.error = None                   # a member's engine error: the response fails

    def add(self, ex) -> None:
        ex.group, ex.index = self, len(self.members)
        self.members.append(ex)
        self.num_running += 1

    def open(self, ex) -> bool:
        """A choice's first token: -> True when it opens the response (the first of them)."""
        if self.opened:
            return False
        self.opened, self.timeline = True, ex.timeline
        return True

    def end(self, ex, out):
        """Member `ex` ended with `out`. -> the output that ends the response (usage summed over
        the choices), when it was the last member; else None."""
        self.num_running -= 1
        self.num_output_tokens += out.num_output_tokens
        if ex.index == 0:
            self.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason == FINISH_ERROR and self.error is None:
            self.error = out.error
        if not ex.streaming:
            self.results[ex.index] = ("".join(ex.texts), ex.token_ids, ex.logprobs, out.finish_reason)
        if self.num_running:
            return None
        if self.error is not None:
            out = out._replace(finish_reason=FINISH_ERROR, error=self.error)
        return out._replace(num_output_tokens=self.num_output_tokens, num_cached_tokens=self.num_cached_tokens)

    def score(self, ex, logprobs) -> None:
        """Add a whole response's new tokens' log-probabilities to its member's score."""
        self.scores[ex.index] = self.scores.get(ex.index, 0.0) + sum(lp.token_logprob for lp in logprobs)

    def chosen(self) -> list:
        """Whole response: -> [(index in the response, member index)]: every member by index,
        or with best_of > n the n best by mean token log-probability."""
        if self.n == len(self.members):
            return [(i, i) for i in range(self.n)]
        def mean_logprob(i):
            return self.scores.get(i, 0.0) / max(1, len(self.results[i][1]))
        best = sorted(range(len(self.members)), key=mean_logprob, reverse=True)[:self.n]
        return list(enumerate(best))


def whole_body(group: ChoiceGroup, chat: bool, response_id: str, created: int, model: str, use: dict,
               want_logprobs: bool, token_text) -> bytes:
    """One body with every returned choice (rule 3)."""
    choices = []
    for index, member in group.chosen():
        text, token_ids, logprobs, reason = group.results[member]
        if chat:
            lps = encoders.chat_logprobs(token_ids, logprobs, token_text) if want_logprobs else None
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None if lps is None else {"content": lps}, "finish_reason": reason})
        else:
            lps = encoders.completion_logprobs(token_ids, logprobs, token_text) if want_logprobs else None
            choices.append({"index": index, "text": text, "logprobs": lps, "finish_reason": reason})
    return encoders.choices_body(chat, response_id, created, model, choices, use)
