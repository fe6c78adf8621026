"""The mock engine: an `Executor` that costs a fixed time per step and emits a fixed text.

Used by `tokenwire bench scheduler`, by the peer benchmarks and by `tokenwire serve
--backend mock --mock-step-us N`, so everything around the model (scheduler, detokenizer,
HTTP/2 framing) can be measured without one. Contract:
- `MockExecutor.launch(seqs)` starts a step of `step_us` on a pretend device (when the
  previous step ends, or now) and returns at once; `collect(handle)` sleeps, without the GIL,
  for what is left of it, as a CUDA event wait would. Each sampling sequence gets token
  `i % n` of `MOCK_TEXT`'s encoding, `i = len(output_token_ids) + num_pending` (its place in
  the output): every request streams the same story, whatever the batch, across preemptions
  and with its last token not read yet (an overlapped step). `step(seqs)` is both.
- `build_mock_tokenizer()` is a real byte-level BPE `tokenizers.Tokenizer` built in memory
  (256 byte tokens, merges for the story's words, `<s>` = 0 and `</s>` = 1 special), so
  detokenization is the real code path, multi-byte characters split over tokens included.
- The mock never emits `</s>`: requests end on max_tokens, stop strings or the context length.
"""

import time
from typing import NamedTuple, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..core.config import ModelConfig
from ..core.detokenizer import byte_level_alphabet
from ..core.executor import SeqStep, StepOutput
from ..core.options import DEFAULTS, EngineOptions

MOCK_TEXT = ("Once upon a time, there was a little robot named Tok. Tok loved to stream words, one token "
             "at a time, as fast as the wire allowed. Every morning Tok said \"bonjour\" to the café "
             "owner, a naïve poet who wrote haiku in 日本語 and signed them with 🙂. The poet smiled: "
             "\"Speed is nothing without the right words.\" So Tok learned new words every day, and "
             "the story went on and on.\n")
BOS, EOS = "<s>", "</s>"
# ChatML, the mock model's chat template (bos/eos are the tokenizer's)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MAX_MODEL_LEN = 4096                    # context when the options give none
NUM_BLOCKS = 16384                      # KV blocks when the options give none: the mock stores nothing


def build_mock_tokenizer():
    """Byte-level BPE over MOCK_TEXT's words; deterministic, no file, no training run."""
    char_of = {b: c for c, b in byte_level_alphabet().items()}
    vocab = {BOS: 0, EOS: 1}
    for b in range(256):
        vocab[char_of[b]] = len(vocab)
    merges = []
    words = [w for w, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(MOCK_TEXT)]
    for word in dict.fromkeys(words):       # each word merged left to right into one token
        left = word[0]
        for right in word[1:]:
            if left + right not in vocab:
                merges.append((left, right))
                vocab[left + right] = len(vocab)
            left += right
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    return tokenizer


def mock_config(vocab_size: int, max_model_len: int) -> ModelConfig:
    """A ModelConfig for the mock: only vocab_size and the context length mean anything."""
    return ModelConfig(architecture="MockForCausalLM", vocab_size=vocab_size, hidden_size=8, intermediate_size=8,
                       num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                       max_position_embeddings=max_model_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=0, eos_token_ids=(1,))


class MockHandle(NamedTuple):
    output: StepOutput                  # known at launch: the story does not depend on the model
    done_s: float                       # perf_counter() when the step ends on the pretend device


class MockExecutor:
    """Executor with a fixed step time and a fixed token stream (see the module docstring)."""
    overlaps = True

    def __init__(self, *, step_us: float = 0.0, num_blocks: int = NUM_BLOCKS, block_size: int = DEFAULTS.block_size,
                 max_model_len: int = MAX_MODEL_LEN, tokenizer=None):
        if step_us < 0:
            raise ValueError(f"step_us must be >= 0, got {step_us}")
        self.tokenizer = tokenizer if tokenizer is not None else build_mock_tokenizer()
        self.text_token_ids = self.tokenizer.encode(MOCK_TEXT, add_special_tokens=False).ids  # [n]
        self.config = mock_config(self.tokenizer.get_vocab_size(with_added_tokens=True), max_model_len)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step_s = step_us / 1e6
        self.step_ns = round(step_us * 1000)   # what the "device" takes for any step: prefill is free
        self.num_steps = 0
        self._busy_until_s = 0.0            # perf_counter() when the last launched step ends

    def launch(self, seqs: Sequence[SeqStep]) -> MockHandle:
        """Hot path: once per step. A step launched while the last one runs starts when it ends."""
        output = self.sample(seqs)
        self.num_steps += 1
        if not self.step_s:
            return MockHandle(output, 0.0)
        self._busy_until_s = max(time.perf_counter(), self._busy_until_s) + self.step_s
        return MockHandle(output._replace(busy_ns=self.step_ns), self._busy_until_s)

    @staticmethod
    def collect(handle: MockHandle) -> StepOutput:
        """Sleeping releases the GIL, as a wait for a real device would."""
        if handle.done_s:
            left_s = handle.done_s - time.perf_counter()
            if left_s > 0:
                time.sleep(left_s)
        return handle.output

    def step(self, seqs: Sequence[SeqStep]) -> StepOutput:
        return self.collect(self.launch(seqs))

    def sample(self, seqs: Sequence[SeqStep]) -> StepOutput:
        """The story's next token for each sampling sequence (tests override this)."""
        text, n = self.text_token_ids, len(self.text_token_ids)
        return StepOutput([text[(len(s.output_token_ids) + s.num_pending) % n] for s in seqs if s.sample])

    def close(self) -> None:
        pass


class MockModel:
    """The model the mock backend brings instead of an engine directory: the story's
    tokenizer, a config that fixes only the vocabulary and the context, a ChatML template."""
    name = "mock"
    add_bos = False
    bos_token_id = 0
    eos_token_ids = (1,)
    special_tokens = {"bos_token": BOS, "eos_token": EOS}
    chat_template = CHAT_TEMPLATE

    def __init__(self, step_us: float, max_model_len: int):
        self.tokenizer = build_mock_tokenizer()
        self.config = mock_config(self.tokenizer.get_vocab_size(with_added_tokens=True), max_model_len)
        self.description = f"mock engine: a fixed story, {step_us:g} us per step"

    def encode_prompt(self, text: str) -> list:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def load_model(options: EngineOptions) -> MockModel:
    """kernels.BACKENDS["mock"]: the mock's own model (no engine directory is read)."""
    return MockModel(options.mock_step_us, options.max_model_len or MAX_MODEL_LEN)


def create_executor(model: MockModel, options: EngineOptions, max_model_len: int) -> MockExecutor:
    """kernels.BACKENDS["mock"]: the executor over `load_model`'s model."""
    return MockExecutor(step_us=options.mock_step_us, num_blocks=options.num_kv_blocks or NUM_BLOCKS,
                        block_size=options.block_size, max_model_len=max_model_len, tokenizer=model.tokenizer)
