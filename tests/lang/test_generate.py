"""Generators: ``:generate (sample ROOT ...)`` on a stage, the ``defrun`` or an eval
pass compiles to a :class:`Generator` whose records the loss (or the metrics) read,
and each mistake in it is one positioned line (docs/generate.md).

The programs compile against the project's own plugins (tests/catalogs.py): the
prompts and the verifier are the built-in ``sort`` source's.
"""

from __future__ import annotations

import pytest

from sexpgpu.errors import SourceError
from sexpgpu.lang.ir import TensorType
from tests.catalogs import compile_text

FILE = "gen.sx"

# Each part a test replaces sits alone on its line, so every position stays put.
TEMPLATE = """\
(defknob group 4 "samples per prompt")
(defmodel net (vocab dim)
  (param embed [vocab dim] :init (normal 0.02))
  (param head [dim vocab] :init (normal 0.02))
  (forward (ids) {forward}))
(defdata train (sort :vocab 16 :length 6) :seq 16 :batch 8)
(defdata held-out (sort :vocab 16 :length 6 :split "eval") :seq 16 :batch 4)
{defdata}
(defrun gen
  :model (net 20 8)
  :optimizer (adam :lr 0.01)
  :counters {counters}
  :stages ((stage imitate :steps 2 :data train
            :loss {imitate})
           (stage reinforce :steps 2 :data {data}
            :generate {generate}
            :loss {loss}))
  :evals ((eval sampled :every 2 :data held-out
           :generate (sample model :new-tokens 5 :temperature 0)
           :metrics (reward
                     generated-length))))
"""

DEFAULTS = {
    "forward": "(matmul (take embed ids) head)",
    "defdata": "; no more data",
    "counters": "(tokens records generated)",
    "imitate": "(cross-entropy (model inputs) targets)",
    "data": "train",
    "generate": "(sample model :new-tokens 7 :samples group :temperature 1.0 :stop 15)",
    "loss": "(neg (mean (* (- reward (group-mean reward :size group))"
    " (sum (* (gather (log-softmax (model sequence)) next) next-mask) :axis 1))))",
}

# where a part starts: line 16, column 23 is the ( of the reinforce stage's (sample ...)
SAMPLE = "gen.sx:16:23"
ROOT = "gen.sx:16:31"
USAGE = "(sample model :new-tokens N :samples G :temperature T ...)"


def source(**parts: str) -> str:
    return TEMPLATE.format(**{**DEFAULTS, **parts})


def sample(options: str, root: str = "model") -> str:
    """A ``(sample ...)`` of the root ``root`` with ``options``."""
    return f"(sample {root} {options})"


def inside(options: str, token: str) -> str:
    """Where ``token`` is in the reinforce stage's ``(sample model options)``."""
    return f"gen.sx:16:{23 + sample(options).index(token)}"


def compiled(**parts: str):
    return compile_text(source(**parts), FILE)


def error(**parts: str) -> str:
    with pytest.raises(SourceError) as raised:
        compiled(**parts)
    return str(raised.value)


def at(text: str, where: str) -> str:
    """The text of ``text`` at ``where`` (``file:line:col``) onwards, on its line."""
    _, line, col = where.split(":")
    return text.splitlines()[int(line) - 1][int(col) - 1 :]


def record_fields(records: int, data_seq: int, prompt: int, new: int) -> dict[str, TensorType]:
    """The records' fields for ``sort``'s data (inputs, targets) as docs/generate.md lists them."""
    return {
        "inputs": TensorType((records, data_seq), "i64"),
        "targets": TensorType((records, data_seq), "i64"),
        "prompt": TensorType((records, prompt), "i64"),
        "completion": TensorType((records, new), "i64"),
        "completion-mask": TensorType((records, new), "f32"),
        "sampled-logp": TensorType((records, new), "f32"),
        "sequence": TensorType((records, data_seq), "i64"),
        "next": TensorType((records, data_seq), "i64"),
        "next-mask": TensorType((records, data_seq), "f32"),
        "reward": TensorType((records,), "f32"),
    }


# ---------------------------------------------------------------- a good program


def test_the_template_places_each_part_where_the_errors_say():
    text = source()
    assert at(text, SAMPLE).startswith("(sample model :new-tokens 7")
    assert at(text, ROOT).startswith("model :new-tokens 7")


def test_a_stage_with_generate_gets_a_generator_over_the_records():
    program = compiled()
    imitate, reinforce = program.stages
    assert imitate.generator is None
    assert imitate.fields == imitate.data.fields
    gen = reinforce.generator
    assert gen is not None
    assert gen.name == "stage reinforce" and gen.root == "model"
    assert (gen.new_tokens, gen.samples, gen.temperature) == (7, 4, 1.0)
    assert (gen.top_k, gen.top_p, gen.stop, gen.pad) == (0, 1.0, 15, 15)
    assert gen.prompt_length == 7  # sort: :length 6 symbols and the separator
    assert gen.vocab == 20  # the model's logits, not the data's :vocab 16
    fields = record_fields(8 * 4, 16, 7, 7)
    assert dict(gen.fields) == fields and list(gen.fields) == list(fields)
    assert dict(reinforce.fields) == fields
    assert gen.logits.output_types() == (TensorType((32, 16, 20), "f32"),)
    assert gen.reward is None and gen.verify is not None
    assert (gen.pos.line, gen.pos.col) == (16, 23)
    assert reinforce.loss.output_types() == (TensorType((), "f32"),)


def test_an_eval_pass_with_generate_gets_a_generator():
    (sampled,) = compiled().evals
    gen = sampled.generator
    assert gen is not None
    assert gen.name == "eval sampled" and gen.root == "model"
    assert (gen.new_tokens, gen.samples, gen.temperature, gen.stop, gen.pad) == (5, 1, 0.0, None, 0)
    assert (gen.prompt_length, gen.vocab) == (7, 20)
    fields = record_fields(4, 16, 7, 5)
    assert dict(gen.fields) == fields and dict(sampled.fields) == fields
    assert gen.logits.output_types() == (TensorType((4, 16, 20), "f32"),)
    assert gen.reward is None and gen.verify is not None
    assert sampled.metrics == ("reward", "generated-length")


def test_the_defrun_itself_can_generate():
    text = source().split("(defrun")[0] + (
        "(defrun one :model (net 20 8) :optimizer (adam :lr 0.01) :steps 2 :data train\n"
        "  :generate (sample model :new-tokens 4 :samples 2 :top-k 5 :top-p 0.9 :prompt 3\n"
        "             :reward (sum completion-mask :axis 1))\n"
        "  :loss (neg (mean (* reward (sum sampled-logp :axis 1)))))\n"
    )
    (main,) = compile_text(text, FILE).stages
    gen = main.generator
    assert gen is not None and gen.name == "stage main"
    assert (gen.samples, gen.top_k, gen.top_p, gen.prompt_length) == (2, 5, 0.9, 3)
    assert dict(main.fields) == record_fields(16, 16, 3, 4)


def test_a_sample_may_fill_the_sequence_exactly():
    gen = compiled(generate=sample(":new-tokens 9")).stages[1].generator
    assert gen.prompt_length + gen.new_tokens == 16


# ---------------------------------------------------------------- the reward


def test_a_reward_expression_is_a_graph_giving_one_number_per_record():
    reward = "(cast (== (sum completion :axis 1) 0) f32)"
    gen = compiled(generate=sample(f":new-tokens 7 :samples group :reward {reward}"))
    gen = gen.stages[1].generator
    assert gen.verify is None
    assert gen.reward is not None
    assert gen.reward.output_types() == (TensorType((32,), "f32"),)
    names = {n.attrs["name"] for n in gen.reward.nodes if n.op == "input"}
    assert names == {"completion"}


def test_a_reward_that_is_not_f32_is_cast_to_it():
    gen = compiled(generate=sample(":new-tokens 7 :reward (sum completion :axis 1)"))
    reward = gen.stages[1].generator.reward
    assert reward.output_types() == (TensorType((8,), "f32"),)
    assert reward.nodes[reward.outputs[0]].op == "cast"


def test_a_reward_may_read_the_datas_fields_and_the_root():
    reward = "(mean (gather (log-softmax (model sequence)) next) :axis 1)"
    gen = compiled(generate=sample(f":new-tokens 7 :reward {reward}")).stages[1].generator
    assert gen.reward.output_types() == (TensorType((8,), "f32"),)


# ---------------------------------------------------------------- files with no prompts


def _bytes(tmp_path) -> str:
    path = tmp_path / "bytes.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 4)
    return f'(defdata bytes (text :path "{path}") :seq 16 :batch 2)'


def test_a_source_with_no_prompts_takes_prompt_n(tmp_path):
    reward = ":reward (cast (sum completion-mask :axis 1) f32)"
    program = compiled(
        defdata=_bytes(tmp_path),
        data="bytes",
        generate=sample(f":new-tokens 4 :samples 4 :prompt 4 {reward}"),
    )
    gen = program.stages[1].generator
    assert (gen.prompt_length, gen.verify) == (4, None)
    assert gen.fields["prompt"] == TensorType((8, 4), "i64")
    assert gen.fields["inputs"] == TensorType((8, 16), "i64")


def test_a_source_with_no_prompts_needs_prompt_n(tmp_path):
    assert error(defdata=_bytes(tmp_path), data="bytes") == (
        f"{SAMPLE}: the data source 'text' gives no prompts; say how many tokens of its "
        "inputs make one with :prompt N"
    )


def test_a_source_with_no_verifier_needs_a_reward(tmp_path):
    got = error(defdata=_bytes(tmp_path), data="bytes", generate=sample(":new-tokens 4 :prompt 4"))
    assert got == (
        f"{SAMPLE}: the data source 'text' has no verifier; give sample a :reward "
        "expression over the records' fields"
    )


# ---------------------------------------------------------------- mistakes, each at its place


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        pytest.param(
            {"generate": "(greedy model :new-tokens 7)"},
            f"{SAMPLE}: :generate takes {USAGE}, got (greedy model :new-tokens 7)",
            id="not-a-sample",
        ),
        pytest.param(
            {"generate": "model"},
            f"{SAMPLE}: :generate takes {USAGE}, got model",
            id="a-bare-symbol",
        ),
        pytest.param(
            {"generate": "(sample)"},
            f"{SAMPLE}: :generate takes {USAGE}, got (sample)",
            id="an-empty-sample",
        ),
        pytest.param(
            {"generate": "(sample :new-tokens 7)"},
            f"{SAMPLE}: sample names the root it samples from first: {USAGE}",
            id="no-root",
        ),
        pytest.param(
            {"generate": "(sample model other :new-tokens 7)"},
            f"{SAMPLE}: sample names the root it samples from first: {USAGE}",
            id="two-roots",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7", root="modle")},
            f"{ROOT}: sample: unknown root 'modle' (did you mean 'model'?); roots: model",
            id="unknown-root",
        ),
        pytest.param(
            {"generate": sample(":samples 2")},
            f"{SAMPLE}: sample needs :new-tokens (tokens to make per record): {USAGE}",
            id="no-new-tokens",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 10")},
            inside(":new-tokens 10", "10")
            + ": a prompt of 7 tokens and 10 new ones do not fit the sequence "
            "of 16 (data 'train' :seq 16)",
            id="too-long",
        ),
        pytest.param(
            {"generate": sample(":prompt 12 :new-tokens 5 :reward 1.0")},
            inside(":prompt 12 :new-tokens 5 :reward 1.0", "5 ")
            + ": a prompt of 12 tokens and 5 new ones do not fit the sequence "
            "of 16 (data 'train' :seq 16)",
            id="too-long-prompt",
        ),
        pytest.param(
            {"generate": sample(":prompt 3 :new-tokens 5")},
            inside(":prompt 3 :new-tokens 5", "3")
            + ": the data source 'sort' verifies answers after its own prompt of 7 tokens; "
            "with :prompt 3 give sample a :reward",
            id="prompt-unlike-the-verifier-s",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 0")},
            inside(":new-tokens 0", "0)") + ": :new-tokens must be an integer >= 1, got 0",
            id="no-new-tokens-at-all",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :samples 0")},
            inside(":new-tokens 7 :samples 0", "0)") + ": :samples must be an integer >= 1, got 0",
            id="no-samples",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :stop -1")},
            inside(":new-tokens 7 :stop -1", "-1") + ": :stop must be an integer >= 0, got -1",
            id="negative-stop",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :top-k -1")},
            inside(":new-tokens 7 :top-k -1", "-1") + ": :top-k must be an integer >= 0, got -1",
            id="negative-top-k",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :new-tokens 3")},
            inside(":new-tokens 7 :new-tokens 3", ":new-tokens 3") + ": :new-tokens is given twice",
            id="an-option-twice",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :temperature -0.5")},
            inside(":new-tokens 7 :temperature -0.5", "-0.5")
            + ": :temperature must be >= 0 (0 takes the likeliest token), got -0.5",
            id="negative-temperature",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :top-p 0")},
            inside(":new-tokens 7 :top-p 0", "0)")
            + ": :top-p must be above 0 and at most 1, got 0.0",
            id="top-p-zero",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :top-p 1.5")},
            inside(":new-tokens 7 :top-p 1.5", "1.5")
            + ": :top-p must be above 0 and at most 1, got 1.5",
            id="top-p-above-one",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :stop 20")},
            inside(":new-tokens 7 :stop 20", "20")
            + ": :stop 20 is not a token of the vocabulary of 20",
            id="stop-outside-vocab",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :top-k 21")},
            inside(":new-tokens 7 :top-k 21", "21")
            + ": :top-k 21 is more than the vocabulary of 20",
            id="top-k-above-vocab",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :temprature 0.5")},
            inside(":new-tokens 7 :temprature 0.5", ":temprature")
            + ": sample has no option :temprature (did you mean 'temperature'?); "
            "its options: :new-tokens, :samples, :temperature, :top-k, :top-p, :stop, "
            ":prompt, :reward",
            id="unknown-option",
        ),
        pytest.param(
            {
                "defdata": "(defdata pics (shapes :classes 4 :size 8) :seq 1 :batch 2)",
                "data": "pics",
            },
            f"{SAMPLE}: a generator's prompts are tokens: data 'pics' has no field inputs "
            "i64[batch, seq] (it has inputs, targets)",
            id="no-token-inputs",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :reward (mean (cast completion f32))")},
            inside(":new-tokens 7 :reward (mean (cast completion f32))", "(mean")
            + ": :reward must give one number per record, f32[8], got f32[]",
            id="scalar-reward",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :reward completion-mask")},
            inside(":new-tokens 7 :reward completion-mask", "completion-mask")
            + ": :reward must give one number per record, f32[8], got f32[8, 7]",
            id="matrix-reward",
        ),
        pytest.param(
            {"generate": sample(":new-tokens 7 :reward (* reward 2.0)")},
            inside(":new-tokens 7 :reward (* reward 2.0)", "reward 2.0")
            + ": unknown name 'reward'",
            id="reward-reads-reward",
        ),
        pytest.param(
            {
                "forward": "(sum (matmul (take embed ids) head) :axis 2)",
                "imitate": "(mean (model inputs))",
            },
            f"{ROOT}: sample: the root 'model' on the sequence i64[32, 16] must give logits "
            "[32, 16, vocab], got f32[32, 16]",
            id="logits-2d",
        ),
        pytest.param(
            {
                "forward": "(mean (matmul (take embed ids) head))",
                "imitate": "(model inputs)",
            },
            f"{ROOT}: sample: the root 'model' on the sequence i64[32, 16] must give logits "
            "[32, 16, vocab], got f32[]",
            id="logits-scalar",
        ),
        pytest.param(
            {
                "forward": "(cast (matmul (take embed ids) head) i64)",
                "imitate": "(mean (cast (model inputs) f32))",
            },
            f"{ROOT}: sample: the root 'model' gives i64[32, 16, 20], not floating logits",
            id="logits-integer",
        ),
        pytest.param(
            {"imitate": "(mean completion-mask)"},
            "gen.sx:14:25: unknown name 'completion-mask'",
            id="record-field-without-generate",
        ),
        pytest.param(
            {"counters": "(tokens generatd)"},
            "gen.sx:12:21: unknown counter 'generatd' (did you mean 'generated'?); "
            "counters: generated, records, tokens",
            id="unknown-counter",
        ),
    ],
)
def test_a_mistake_is_one_line_at_its_place(parts, expected):
    assert error(**parts) == expected


def test_the_generated_counter_is_accepted():
    assert compiled(counters="(generated)").run.counters == ("generated",)


def test_the_generating_metrics_need_a_pass_that_generates():
    # the pass without :generate reads the data's batch, which has no reward
    plain = source().replace(
        "           :generate (sample model :new-tokens 5 :temperature 0)\n", ""
    )
    with pytest.raises(SourceError) as raised:
        compile_text(plain, FILE)
    assert str(raised.value) == (
        "gen.sx:19:22: the eval metric 'reward' of the plugin 'eval' does not fit the pass "
        "'sampled': <metric reward>:1:7: unknown name 'reward'"
    )
