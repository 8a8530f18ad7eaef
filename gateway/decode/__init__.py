"""The decode engine: choices, the decode loop, sampling, logprobs, stop strings, detokenizing."""
