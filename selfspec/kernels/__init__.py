"""CPU kernels a target or a draft head may swap in (prepacked, skinny and int8 linear layers,
packed grouped-query attention); each is exact to its reference up to floating-point rounding."""
