"""ShapesWorld, the embedded synthetic world (DESIGN.md, "ShapesWorld"): its domain code, low in the house.

    scenes.py   seeded scenes of coloured shapes, their captions, the caption parser and verifier,
                held-out (colour, shape) pairs, `stable_seed`
    render.py   images and videos of a scene, and the verifiers that read a scene back from pixels
    speech.py   captions spoken as speech-like audio, and the verifier that reads the words back

Plain Python, numpy and torch: no Lightning, no model, no datamodule. The datamodules (`shapes_data`,
`shapes_multimodal`, `media_data`, `shapes_cascade`), the word-identity teacher of the audio codec, the
evaluation and the RL verifiers all read the world from here.
"""
