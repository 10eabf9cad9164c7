from hybridrl.reward.scorers import gsm8k

__all__ = ["gsm8k"]
