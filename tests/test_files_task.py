"""A user's data file as the task: JSONL, JSON, Parquet and datasets directories, dotted keys, chat
messages, the seeded order and the held-out slice; a bad file stops the stage with one line naming
the file, the line and the key. Also the prompt path: chat template, end-of-turn and stop ids, and a
real engine stopping on them.
Run: pytest tests/test_files_task.py
"""

import json
import os
import re
import shutil
import subprocess

import pytest
import zmq

from conftest import start_engine, stop_process
from harness.servers import REPO_ROOT, proc_command
from nano_miles.engine.client import EngineClient
from nano_miles.run.cli import UserError
from nano_miles.run.config import Config, load_config
from nano_miles.run.sections import RunConfig, TaskConfig
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.tasks import Problem, load_problems
from nano_miles.tasks.files import read_problems
from nano_miles.tasks.prompts import encode_prompts, end_of_turn_id, load_tokenizer, prompt_text, stop_token_ids
from nano_miles.tasks.word_problems import make_records, write_jsonl

FILES = "nano_miles.tasks.files"


def files_config(train, seed=0, **task) -> Config:
    return Config(run=RunConfig(seed=seed), task=TaskConfig(name=FILES, train_file=str(train), **task))


@pytest.fixture
def gsm8k_style(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, make_records("train", 120))
    return path


def test_jsonl_records_become_problems_in_a_seeded_order(gsm8k_style):
    cfg = files_config(gsm8k_style, prompt_key="question", label_key="answer", num_test=20)
    train, test = load_problems(cfg, "train"), load_problems(cfg, "test")
    records = {r["question"]: r["answer"] for r in map(json.loads, gsm8k_style.read_text().splitlines())}
    assert len(train) == 100 and len(test) == 20 and not {p.prompt for p in train} & {p.prompt for p in test}
    assert all(records[p.prompt] == p.answer for p in train + test)
    assert load_problems(cfg, "train") == train  # the same order in every process
    reseeded = load_problems(files_config(gsm8k_style, seed=1, prompt_key="question", label_key="answer",
                                          num_test=20), "train")
    assert reseeded != train and sorted(map(str, reseeded)) == sorted(map(str, train))
    assert load_problems(files_config(gsm8k_style, seed=1, prompt_key="question", label_key="answer",
                                      num_test=20), "test") == test  # the held-out slice ignores the seed


def test_the_held_out_slice_does_not_move_with_the_file_order(gsm8k_style, tmp_path):
    lines = gsm8k_style.read_text().splitlines()
    reversed_path = tmp_path / "reversed.jsonl"
    reversed_path.write_text("\n".join(reversed(lines)) + "\n")
    held_out = [{p.prompt for p in load_problems(files_config(path, prompt_key="question", label_key="answer",
                                                               num_test=15), "test")}
                for path in (gsm8k_style, reversed_path)]
    assert held_out[0] == held_out[1] and len(held_out[0]) == 15


def test_a_test_file_dotted_keys_and_chat_messages(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.json"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    write_jsonl(train, [{"prompt": messages, "reward_model": {"ground_truth": 4}},
                        {"prompt": "3+3?", "reward_model": {"ground_truth": "6"}}])
    test.write_text(json.dumps([{"prompt": "1+1?", "reward_model": {"ground_truth": 2}}]))
    cfg = files_config(train, test_file=str(test), label_key="reward_model.ground_truth", num_test=0)
    assert sorted(load_problems(cfg, "train"), key=str) == sorted(
        [Problem(tuple(messages), "4"), Problem("3+3?", "6")], key=str)
    assert load_problems(cfg, "test") == [Problem("1+1?", "2")]


DIRECTORY = object()  # the path is a directory that no datasets' save_to_disk wrote
NEEDS_PARQUET = "needs the datasets package to read Parquet"
# (file name, what it holds: text, bytes, None = nothing there, DIRECTORY; the prompt key; the one line)
BAD_DATA = [
    ("data.jsonl", None, "prompt", r"{path}: no such file \(task.train_file\)"),
    ("data.jsonl", '{"prompt": "a", "label": "1"}\n{"prompt": "b"}\n', "prompt",
     r"{path}:2: no key 'label' \(task.label_key\); the record has 'prompt'"),
    ("data.jsonl", '{"prompt": "a", "label": "1"}\n\n{"prompt": "  ", "label": "2"}\n', "prompt",
     r"{path}:3: empty prompt under 'prompt'"),
    ("data.jsonl", '{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": \n', "prompt", r"{path}:2: not valid JSON"),
    ("data.json", '[{"prompt": "a", "label": "1"},\n {"prompt": "b"', "prompt", r"{path}:2: not valid JSON"),
    ("data.jsonl", '{"q": "a", "label": "1"}\n', "question", r"{path}:1: no key 'question' \(task.prompt_key\)"),
    ("data.jsonl", '["a", "b"]\n', "prompt", r"{path}:1: a record must be a JSON object"),
    ("data.jsonl", '{"prompt": 7, "label": "1"}\n', "prompt",
     r"{path}:1: 'prompt' must be text or a list of chat messages"),
    ("data.jsonl", "\n\n", "prompt", r"{path}: no records"),
    ("data.jsonl", b'{"prompt": "a", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n', "prompt",
     r"{path}:2: not UTF-8 text \(byte 0xe9\); save the file as UTF-8"),
    ("data.jsonl", '{"prompt": [{"role": "user"}], "label": "1"}\n', "prompt",
     r"""{path}:1: chat messages under 'prompt' must be {{"role", "content"}} objects, not {{"role": "user"}}"""),
    ("data.jsonl", '{"prompt": [{"role": "bot", "content": "hi"}], "label": "1"}\n', "prompt",
     r"{path}:1: chat messages under 'prompt' must have a role of system, user, assistant or tool, not 'bot'"),
    ("data.jsonl", '{"prompt": [{"role": "user", "content": ["hi"]}], "label": "1"}\n', "prompt",
     r"{path}:1: chat messages under 'prompt' must have text content, not list"),
    ("data.jsonl", '{"prompt": "a", "label": ["1", "one"]}\n', "prompt",
     r"{path}:1: 'label' must be text or a number \(the reward function gets it as text\), not list"),
    ("data.jsonl", '{"prompt": "a", "label": true}\n', "prompt",
     r"{path}:1: 'label' must be text or a number .*, not bool"),
    ("data.jsonl", DIRECTORY, "prompt", r"{path}: a directory, but not one datasets' save_to_disk wrote"),
    ("data", DIRECTORY, "prompt", r"{path}: a directory, but not one datasets' save_to_disk wrote"),
    ("data.parquet", b"PAR1 cut short", "prompt",
     rf"{{path}}: (not readable as Parquet \(ArrowInvalid|{NEEDS_PARQUET})"),
]


@pytest.mark.parametrize("name, content, key, message", BAD_DATA,
                         ids=[f"{i}-{row[0]}" for i, row in enumerate(BAD_DATA)])
def test_a_bad_file_is_one_line_naming_file_line_and_key(tmp_path, name, content, key, message):
    path = tmp_path / name
    if content is DIRECTORY:
        path.mkdir()
        (path / "notes.txt").write_text("not a dataset")
    elif content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    pattern = message.format(path=path)
    with pytest.raises(UserError, match=pattern):
        read_problems(str(path), (key, "label"), "train")
    # the stage that reads it stops at its start: one line, exit 2, no traceback
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOMILES_")}
    result = subprocess.run([*proc_command("rollout"), f"--run.dir={tmp_path}/run",
                             f"--task.name={FILES}", f"--task.train_file={path}", f"--task.prompt_key={key}",
                             "--task.num_test=1", "--task.chat_template=true"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollout: ") and re.search(pattern, lines[0]), result.stderr


def test_no_held_out_set_is_refused_at_the_start(gsm8k_style, tmp_path, monkeypatch):
    """The trainer evaluates the test split at least once (trainer.eval_every = 0: at the end), so a
    config that leaves it empty is refused where the split is made, in every stage that reads it."""
    cfg = files_config(gsm8k_style, prompt_key="question", label_key="answer", num_test=0)
    for split in ("train", "test"):
        with pytest.raises(UserError, match=r"task.num_test = 0 .* there is none: set task.test_file, or "
                                            r"task.num_test > 0"):
            load_problems(cfg, split)
    # a task of the user's whose test split is empty: the same one line, whatever made it empty
    (tmp_path / "no_tests.py").write_text(
        "from nano_miles.tasks import Problem\n"
        "def load_split(cfg, split):\n    return [Problem('1+1', '2')] if split == 'train' else []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"^the test split of no_tests is empty: the trainer evaluates it$"):
        load_problems(Config(task=TaskConfig(name="no_tests")), "test")


def test_a_test_file_shorter_than_num_test(tmp_path, caplog):
    """Left at its default, task.num_test takes a shorter test file whole and says so in one line; set
    by the user, it must fit, and the error names both numbers."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    write_jsonl(train, make_records("train", 30))
    write_jsonl(test, make_records("test", 7))
    overrides = [f"--task.name={FILES}", f"--task.train_file={train}", f"--task.test_file={test}",
                 "--task.prompt_key=question", "--task.label_key=answer"]
    with caplog.at_level("WARNING", logger="nano_miles.tasks"):
        assert len(load_problems(load_config(overrides=overrides), "test")) == 7
    assert [r.getMessage() for r in caplog.records] == [
        f"task.num_test is 200 by default, but the test split of {FILES} holds 7 problems: using all 7"]
    with pytest.raises(UserError, match=r"^task.num_test is 200, but the test split of .* holds 7 problems: set "
                                        r"at most 7, or 0 to take them all$"):
        load_problems(load_config(overrides=overrides + ["--task.num_test=200"]), "test")
    assert len(load_problems(load_config(overrides=overrides + ["--task.num_test=5"]), "test")) == 5


def test_parquet_and_datasets_directories(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the optional extra 'data' (pip install datasets)")
    records = make_records("train", 30)
    data = datasets.Dataset.from_list(records)
    data.to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict({"train": data, "test": data.select(range(5))}).save_to_disk(str(tmp_path / "dict"))
    keys = ("question", "answer")
    want = [Problem(r["question"], r["answer"]) for r in records]
    assert read_problems(str(tmp_path / "train.parquet"), keys, "train") == want
    assert read_problems(str(tmp_path / "dict"), keys, "train") == want
    assert read_problems(str(tmp_path / "dict"), keys, "test") == want[:5]
    with pytest.raises(UserError, match=r"dict:1: no key 'nope' \(task.label_key\)"):
        read_problems(str(tmp_path / "dict"), ("question", "nope"), "train")
    records[2]["answer"] = None  # a column holds a value for every row, but it may be null
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "nulls.parquet"))
    with pytest.raises(UserError, match=r"nulls.parquet:3: 'answer' is null"):
        read_problems(str(tmp_path / "nulls.parquet"), keys, "train")


def test_chat_template_prompts_and_stop_ids(policy_dir):
    tokenizer = load_tokenizer(policy_dir)
    text = prompt_text(tokenizer, "What is 2?", chat_template=True, system_prompt="Be brief.")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_text(tokenizer, "What is 2?", chat_template=False) == "What is 2?"
    ids = encode_prompts(tokenizer, [Problem("What is 2?", "2")], TaskConfig(chat_template=True))[0]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(tokenizer.eos_token_id) == 0
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end
    assert stop_token_ids(policy_dir, tokenizer, chat_template=True) == sorted({tokenizer.eos_token_id, im_end})
    with pytest.raises(UserError, match="needs task.chat_template=true"):
        prompt_text(tokenizer, ({"role": "user", "content": "hi"},), chat_template=False)


@pytest.fixture(scope="module")
def chat_model_without_turn_end(policy_dir, tmp_path_factory):
    """(model dir, engine URL): the shipped chat policy with a generation_config.json that names only
    <eos> (as many chat models ship it), served by a real local engine."""
    model_dir = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(policy_dir, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 1}))
    proc, url = start_engine(model_dir, model_dir.parent / "engine.log")
    yield model_dir, url
    stop_process(proc)


def test_generation_stops_at_the_templates_end_of_turn_that_generation_config_does_not_name(
        chat_model_without_turn_end, tmp_path):
    model_dir, url = chat_model_without_turn_end
    tokenizer = load_tokenizer(model_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in stop_token_ids(model_dir, tokenizer, chat_template=False)  # neither config names it
    stops = stop_token_ids(model_dir, tokenizer, chat_template=True)
    assert stops == sorted({tokenizer.eos_token_id, im_end})
    # the rollout stage's path: the prompt through the template, the stop ids procs/rollout.py gives it
    cfg = load_config(overrides=[f"--model.path={model_dir}", f"--engine.port={url.rsplit(':', 1)[1]}",
                                 "--task.chat_template=true", "--rollout.group_size=2", "--rollout.max_new_tokens=64",
                                 "--rollout.temperature=0", f"--rollout.control_endpoint=ipc://{tmp_path}/c",
                                 f"--reward.endpoint=ipc://{tmp_path}/r", "--rollout.metrics_port=0"])
    problems = [Problem(r["question"], r["answer"]) for r in make_records("test", 3)]
    ctx = zmq.Context()
    producer = RolloutProducer(cfg, ctx, problems, encode_prompts(tokenizer, problems, cfg.task), stops)
    try:
        samples = [s for i in range(len(problems)) for s in producer.generate_group(f"e0-i{i}", i).samples]
    finally:
        producer.close()
        ctx.destroy(linger=0)
    for s in samples:  # each answer ends its turn, and generation ends with it
        assert s.finish_reason == "stop" and s.response_tokens[-1] == im_end, tokenizer.decode(s.response_tokens)
        assert im_end not in s.response_tokens[:-1] and len(s.response_tokens) < 64
    # the engine alone stops only on the model's EOS: past the end of the turn, to the token limit
    alone = EngineClient(url).generate(producer.records[0].prompt_ids, {"max_new_tokens": 64, "temperature": 0.0})
    assert alone["meta_info"]["finish_reason"]["type"] == "length" and im_end in alone["output_ids"]


def test_a_prompt_the_chat_template_refuses_is_one_line(policy_dir, tmp_path):
    """A template may refuse a chat (roles that do not alternate, a system turn it has no place for):
    the rollout stage, which renders every prompt at its start, stops there with one line naming it."""
    model = tmp_path / "model"
    model.mkdir()
    for f in policy_dir.iterdir():
        if f.name != "chat_template.jinja":
            (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [{"prompt": "What is 2?", "label": "2"}])
    says = "the chat template of .* refuses the prompt 'What is 2\\?': System role not supported"
    with pytest.raises(UserError, match=says):
        prompt_text(load_tokenizer(model), "What is 2?", chat_template=True, system_prompt="Be brief.")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOMILES_")}
    result = subprocess.run([*proc_command("rollout"), f"--run.dir={tmp_path}/run", f"--model.path={model}",
                             f"--task.name={FILES}", f"--task.train_file={data}", f"--task.test_file={data}",
                             "--task.chat_template=true", "--task.system_prompt=Be brief."],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(f"rollout: {says}", lines[0]), result.stderr


def test_the_example_data_is_what_its_generator_writes():
    """examples/word_problems/ is the project's own data, reproducible from its script."""
    for split, num in (("train", 2000), ("test", 200)):
        lines = (REPO_ROOT / "examples" / "word_problems" / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == make_records(split, num)
