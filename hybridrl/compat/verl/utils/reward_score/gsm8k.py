from hybridrl.reward.scorers.gsm8k import compute_score, extract_solution

__all__ = ["compute_score", "extract_solution"]
