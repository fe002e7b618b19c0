"""``python -m slime_hydra.launch.sglang_commands [hydra overrides...]``: the command of every SGLang engine a config
would start, without starting anything (the same lines ``dry_run=true`` prints at the end of its plan; the
rendering is rollout/engines/sglang.py's)."""

import sys

from slime_hydra.config import collect_problems, compose, to_config
from slime_hydra.options import ConfigError, Problem
from slime_hydra.dotted import import_callable
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS


def main(argv: list[str] | None = None) -> int:
    """Compose the config from Hydra overrides, validate it, print every engine's SGLang command; exit 2 on a bad
    config."""
    try:
        cfg = to_config(compose(list(sys.argv[1:] if argv is None else argv)))
        problems, derived = collect_problems(cfg)
        if problems:
            raise ConfigError(problems)
        kind = ENGINE_KINDS[cfg.rollout.backend]
        if kind.commands is None:
            with_commands = [k.name for k in ENGINE_KINDS.values() if k.commands is not None]
            raise ConfigError([Problem(("rollout.backend",), f"rollout.backend={cfg.rollout.backend} has no server "
                                       "command line to print (its engines start inside their actors)",
                                       f"add rollout={with_commands[0]}")])
        lines = import_callable(kind.commands, "engine kind commands", "fn(cfg, derived)")(cfg, derived)
    except ConfigError as error:
        print(f"slime_hydra: {error}", file=sys.stderr)
        return ConfigError.exit_code
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
