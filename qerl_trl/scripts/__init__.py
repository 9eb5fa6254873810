"""The training scripts ``qerl-trl train`` runs, shipped in the package as TRL ships ``trl/scripts/``.

- :mod:`.grpo_gsm8k`: GRPO on GSM8K; :mod:`.dapo_bigmath`: DAPO on BigMath. Each is a TRL-style script with
  ``make_parser()`` (a ``TrlParser``: a YAML recipe plus command-line overrides) and ``main(script_args,
  training_args)``; run one with ``qerl-trl train --config RECIPE``, ``python -m qerl_trl.scripts.grpo_gsm8k``, or
  ``accelerate launch examples/grpo_gsm8k.py`` (a short copy-friendly entry point of a source checkout).
- :mod:`.inputs`: what both read (a dataset split, reward functions by name); :mod:`.training`: the run both end
  with (train, save the adapter, push).
"""

#: The scripts ``qerl-trl train --script`` can run, by module name.
SCRIPTS = ("grpo_gsm8k", "dapo_bigmath")
