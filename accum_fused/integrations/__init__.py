"""Recipes for training frameworks: HF Trainer (``transformers``), Lightning (``lightning``) and
accelerate (``accelerate``). Each submodule imports its framework, so import the one you use
(``from accum_fused.integrations import transformers as af_hf``); importing accum_fused or this
package never imports a framework. They use the optimizers' public surface only.
"""
