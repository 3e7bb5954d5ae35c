"""Rollout producer process: dataset prompts -> engine /generate -> RolloutGroups PUSHed to reward.

Run: python procs/rollout.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    from nano_miles.config import config_or_exit
    cfg, rest = config_or_exit(argv, "rollout", __doc__)
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
