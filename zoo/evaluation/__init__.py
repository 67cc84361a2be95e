"""Evaluation clients over a trained zoo model: the lm-evaluation-harness adapter (`zoo.evaluation.harness`,
needs the `eval` extra) and `zoo eval` (`zoo.evaluation.command`). Nothing is imported here, so that the
package loads without lm-eval installed."""
