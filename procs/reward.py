"""Reward process: PULLs RolloutGroups, scores them, computes group advantages, PUSHes ScoredGroups.

Run: python procs/reward.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> int:
    from nano_miles.config import config_or_exit
    cfg, rest = config_or_exit(argv, "reward", __doc__)
    import zmq
    from nano_miles.pipeline import load_tokenizer, make_decoder, setup_process
    from nano_miles.reward_stage import RewardStage
    from nano_miles.tasks import load_reward_fn

    setup_process("reward", cfg, num_threads=1)
    reward_fn = load_reward_fn(cfg.reward.fn)
    RewardStage(cfg, zmq.Context.instance(), reward_fn, make_decoder(load_tokenizer(cfg))).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
