"""dflash-ray: train DFlash drafters on hidden states from frozen target LLMs, over Ray actors."""
