"""Integrations with other adapter libraries: PEFT and lycoris-lora."""
