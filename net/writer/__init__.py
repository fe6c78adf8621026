"""The writer layer, on the loop: engine steps in, frames out.

`handoff.py` brings each engine step to the loop (or runs short steps on it); `dispatch.py`
writes a step's outputs to every stream, encoded by the request's encoder (`encoders.py`
for the OpenAI and native streams; each API family's own in net/api/), queued per
connection in `outbox.py` and framed in one pass per connection; `choices.py` answers
n > 1 / best_of as one response; `busy_poll.py` keeps the loop polling between requests.
"""
