"""The served tokenizer (tokenizers + jinja2, no transformers) against transformers' own
AutoTokenizer on the same directory: encode, decode and the chat template agree exactly."""

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from grctl.server.tokenizer import ServedTokenizer, load_tokenizer
from tests.support.checkpoints import write_word_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<|sid_begin|>", "<|sid_end|>"]
# a Qwen3-style template: roles, an optional thinking switch, raise_exception, tojson
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
    "{{ {'é': eos_token} | tojson }}"
)
TEXTS = [
    "hello world, the café is open.",
    "<|im_start|>user\nrecommend <|sid_begin|>an item<|sid_end|><|im_end|>",
    "  spaces   and\ttabs\nnewlines  ",
    "<think>reasoning</think>\n<|sid_begin|>",
    "",
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.add_tokens(ADDED)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["bpe", "word"])
def test_encode_and_decode_equal_transformers(kind, bpe_dir, tmp_path):
    if kind == "word":
        (tmp_path / "config.json").write_text('{"vocab_size": 64}')
        write_word_tokenizer(tmp_path)
        path, texts = tmp_path, ["t5 t9 t63", "t1  t2\nt3", "t70 unknown"]
    else:
        path, texts = bpe_dir, TEXTS
    ours, ref = ServedTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.vocab_size == len(ref)


def test_the_chat_template_renders_as_transformers(bpe_dir):
    ours, ref = ServedTokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(bpe_dir)
    messages = [
        {"role": "system", "content": "you recommend"},
        {"role": "user", "content": "what next? <|sid_begin|>"},
    ]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        for gen in (False, True):
            want = ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            got = ours.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            assert got == want
            assert ours.encode(got, add_special_tokens=False) == ref.encode(
                want, add_special_tokens=False
            )
    from jinja2.exceptions import TemplateError

    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(TemplateError, match="unknown role"):
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError):
        ref.apply_chat_template(bad, tokenize=False)


def test_load_tokenizer_needs_no_transformers_for_a_fast_tokenizer(bpe_dir, tmp_path):
    assert isinstance(load_tokenizer(str(bpe_dir)), ServedTokenizer)
    assert load_tokenizer(str(tmp_path)) is None  # no tokenizer files: ids-only serving
    assert load_tokenizer(None) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert load_tokenizer(str(tmp_path)) is None  # broken: logged, ids-only serving


BLOCK_TRANSFORMERS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("transformers is blocked in this server")
sys.meta_path.insert(0, _Block())
"""


def test_a_server_without_transformers_serves_text_and_chat(
    start_server, checkpoint, tmp_path_factory
):
    """`grctl serve` in a process where importing transformers fails: text prompts, decoded
    text and the chat template still work, tokenized as transformers would."""
    from tests.support.checkpoints import with_chat_template

    root = tmp_path_factory.mktemp("notf")
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}t1"
    ckpt = with_chat_template(checkpoint(seed=3, tokenizer=True), root / "ckpt", template)
    blocker = root / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_TRANSFORMERS)
    srv = start_server("--model-path", str(ckpt), env={"PYTHONPATH": str(blocker)})
    ref = transformers.AutoTokenizer.from_pretrained(ckpt)
    with srv.client(timeout=60) as http:
        r = http.post("/generate", json={"text": "t5 t9", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["meta_info"]["prompt_tokens"] == len(ref.encode("t5 t9"))
        assert body["text"] == ref.decode(body["output_ids"])
        chat = http.post(
            "/v1/chat/completions",
            json={
                "model": "x",
                "messages": [{"role": "user", "content": "t5 t9"}],
                "max_tokens": 2,
            },
        )
        assert chat.status_code == 200, chat.text
        rendered = ref.apply_chat_template(
            [{"role": "user", "content": "t5 t9"}], tokenize=False, add_generation_prompt=True
        )
        want = ref.encode(rendered, add_special_tokens=False)
        assert chat.json()["usage"]["prompt_tokens"] == len(want)
    assert "blocked" not in srv.log_text()
