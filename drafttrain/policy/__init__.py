"""The tiny policy world: a verifiable iterated-map task (two ways to write each step), its char tokenizer, and
the Llama policy."""

from drafttrain.policy.model import PolicyConfig, build_policy, load_policy, save_policy
from drafttrain.policy.task import Problem, extract_answer, make_prompts, reward, sample_problem
from drafttrain.policy.tokenizer import build_tokenizer, decode, encode_prompt, load_tokenizer

__all__ = [
    "PolicyConfig", "build_policy", "load_policy", "save_policy",
    "Problem", "extract_answer", "make_prompts", "reward", "sample_problem",
    "build_tokenizer", "decode", "encode_prompt", "load_tokenizer",
]
