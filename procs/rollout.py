"""Rollout producer process: dataset prompts -> engine /generate -> RolloutGroups PUSHed to reward.

Run: python procs/rollout.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from nano_miles.config import ConfigError, config_from_argv
    try:
        cfg, rest = config_from_argv(argv)
    except ConfigError as e:
        print(f"rollout: config error: {e}", file=sys.stderr)
        return 2
    import zmq
    from nano_miles.pipeline import encode_prompts, load_task, load_tokenizer, setup_process
    from nano_miles.rollout import RolloutProducer

    setup_process("rollout", cfg)
    problems = load_task(cfg).make_problems("train", cfg.task.num_train, cfg.task.seed)
    prompts = encode_prompts(load_tokenizer(cfg), problems)
    RolloutProducer(cfg, zmq.Context.instance(), problems, prompts).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
