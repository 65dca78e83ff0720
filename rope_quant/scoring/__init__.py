"""What scores a built model: perplexity (evaluate.py), the long-context protocol (longctx.py), greedy decoding
(generate.py) and the NIAH probes (niah.py)."""
