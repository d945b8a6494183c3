# The affine formats requantized experts (Q2_K, IQ2_XXS, ...) may be given: here, so that the command's
# parser reads them without importing the converter.
EXPERT_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
