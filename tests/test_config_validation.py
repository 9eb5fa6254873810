"""QeRLGRPOConfig refuses every out-of-range QeRL option at construction, before any model loads, with a message
that gives the valid range (issue #40)."""

from __future__ import annotations

import math

import pytest

from qerl_trl import QeRLGRPOConfig


def make(tmp_path, **kw):
    return QeRLGRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, **kw)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(aqn_sigma_start=-0.01), r"aqn_sigma_start must be a finite number > 0 .*got -0.01.*aqn=False"),
        (dict(aqn_sigma_start=math.nan), r"aqn_sigma_start must be a finite number > 0 .*got nan"),
        (dict(aqn_sigma_start=math.inf), r"aqn_sigma_start must be a finite number > 0 .*got inf"),
        (dict(aqn_sigma_end=0.0), r"aqn_sigma_end must be a finite number > 0 .*got 0.0.*aqn=False"),
        (dict(aqn_sigma_end=math.nan), r"aqn_sigma_end must be a finite number > 0"),
        (dict(aqn_sigma_start=1e-3, aqn_sigma_end=1e-2),
         r"aqn_sigma_end \(0.01\) must be <= aqn_sigma_start \(0.001\): AQN decays .* Swap them"),
        (dict(aqn_num_stages=0), r"aqn_num_stages must be an integer >= 2 .*got 0"),
        (dict(aqn_num_stages=1), r"aqn_num_stages must be an integer >= 2 .*got 1"),
        (dict(aqn_num_stages=2.5), r"aqn_num_stages must be an integer >= 2 .*got 2.5"),
        (dict(aqn_apply_to="policy"), r"aqn_apply_to must be 'rollout' or 'rollout_and_policy', got 'policy'"),
        (dict(lora_r=0), r"lora_r must be an integer >= 1 .*got 0"),
        (dict(lora_alpha=0), r"lora_alpha must be a finite number > 0 .*got 0"),
        (dict(lora_alpha=math.nan), r"lora_alpha must be a finite number > 0 .*got nan"),
        (dict(lora_dropout=1.0), r"lora_dropout must be in \[0, 1\) .*got 1.0"),
        (dict(lora_dropout=-0.1), r"lora_dropout must be in \[0, 1\)"),
        (dict(vllm_lora_backend="punica"), r"vllm_lora_backend must be 'vllm' .* or 'qerl' .*got 'punica'"),
        (dict(vllm_fp4_kernel="cutlass"), r"vllm_fp4_kernel must be 'auto', 'humming' or 'marlin', got 'cutlass'"),
        (dict(vllm_max_lora_rank=0), r"vllm_max_lora_rank must be None .* or an integer >= 1, got 0"),
        (dict(vllm_max_logprob_gap=0.0), r"vllm_max_logprob_gap must be a finite number > 0 .*or None"),
        (dict(vllm_max_logprob_gap=math.nan), r"vllm_max_logprob_gap must be a finite number > 0 .*got nan"),
    ],
)
def test_out_of_range_options_are_refused_with_the_valid_range(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kw)


def test_valid_edges_are_accepted(tmp_path):
    args = make(tmp_path, aqn_sigma_start=1e-3, aqn_sigma_end=1e-3, aqn_num_stages=2, lora_r=1, lora_alpha=0.5,
                lora_dropout=0.0, vllm_max_lora_rank=8, vllm_max_logprob_gap=None)  # fmt: skip
    assert args.aqn_sigma_end == args.aqn_sigma_start
    make(tmp_path, aqn=False)  # the defaults with AQN off


def test_the_command_line_gets_the_same_checks(tmp_path):
    """Scripts parse QeRLGRPOConfig with TrlParser: a bad flag fails at parse time with the same message."""
    from trl import TrlParser

    parser = TrlParser((QeRLGRPOConfig,))
    with pytest.raises(ValueError, match=r"aqn_sigma_start must be a finite number > 0 .*got nan"):
        parser.parse_args_and_config(["--output_dir", str(tmp_path), "--aqn_sigma_start", "nan", "--report_to", "none",
                                       "--bf16", "false", "--use_cpu", "true"])
