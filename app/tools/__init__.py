"""What uses a trained run or wraps runs: evaluate, predict, locate a trained model, sweep with Ray Tune."""
