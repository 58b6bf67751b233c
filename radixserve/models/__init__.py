"""Model code for the Llama family: config, rotary, forward pass, weight loading."""
