"""Reward process: PULLs RolloutGroups, scores them, computes group advantages, PUSHes ScoredGroups.

Run: python procs/reward.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
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
        print(f"reward: config error: {e}", file=sys.stderr)
        return 2
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
