"""The real photographs that ship inside the scikit-image and scikit-learn wheels, with the captions
and question/answer pairs we wrote for each, and their licences (from each loader's docstring).

They are the offline source of real image payloads: no hub, no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Photo:
    key: str
    load: Callable[[], np.ndarray]
    """Returns HxW (greyscale) or HxWx3 uint8 pixels."""
    source: str
    licence: str
    captions: tuple[str, ...]
    qa: tuple[tuple[str, str], ...]


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return getattr(skimage.data, name)()

    return load


def _motorcycle(side: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        return skimage.data.stereo_motorcycle()[side]

    return load


def _sklearn(filename: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_image

        return load_sample_image(filename)

    return load


PHOTOS: tuple[Photo, ...] = (
    Photo(
        "astronaut", _skimage("astronaut"), "scikit-image data.astronaut (NASA Great Images)",
        "public domain",
        ("A smiling astronaut in an orange spacesuit poses beside an American flag.",
         "Portrait of an astronaut with a helmet in front of her and a model space shuttle behind.",
         "A NASA astronaut in an orange launch suit, photographed indoors."),
        (("What is the person wearing?", "An orange spacesuit."),
         ("What flag is in the background?", "The flag of the United States."),
         ("Is the person outdoors?", "No, the photo was taken indoors.")),
    ),
    Photo(
        "coffee", _skimage("coffee"), "scikit-image data.coffee (Rachel Michetti, Pikolo Espresso Bar)",
        "CC0",
        ("An espresso in a red cup and saucer on a wooden table, seen from above.",
         "A small red cup of coffee with crema, a spoon resting on the saucer.",
         "Coffee served in red porcelain on a worn wooden table."),
        (("What drink is in the cup?", "An espresso."),
         ("What is lying on the saucer?", "A spoon."),
         ("What colour is the cup?", "Red.")),
    ),
    Photo(
        "chelsea", _skimage("chelsea"), "scikit-image data.chelsea (Stefan van der Walt)",
        "CC0",
        ("A tabby cat looks towards the camera with green eyes.",
         "Close-up of a ginger and brown striped cat named Chelsea.",
         "A cat's face with long whiskers against a blurred background."),
        (("What animal is this?", "A cat."),
         ("What colour are its eyes?", "Green."),
         ("Does the animal have stripes?", "Yes, it is a striped tabby.")),
    ),
    Photo(
        "rocket", _skimage("rocket"), "scikit-image data.rocket (SpaceX)",
        "public domain",
        ("A SpaceX Falcon 9 rocket stands on the launch pad at dusk before lift-off.",
         "A tall white rocket lit by floodlights between lightning towers.",
         "The Falcon 9 launch vehicle on its pad under a deep blue evening sky."),
        (("What vehicle is shown?", "A Falcon 9 rocket."),
         ("Is the rocket flying?", "No, it is standing on the launch pad."),
         ("What tall structures surround the rocket?", "Lightning protection towers.")),
    ),
    Photo(
        "hubble_deep_field", _skimage("hubble_deep_field"), "scikit-image data.hubble_deep_field (NASA)",
        "public domain",
        ("Hundreds of distant galaxies scattered across a black sky in a Hubble deep field.",
         "A deep-space image full of small spiral and elliptical galaxies.",
         "The Hubble eXtreme Deep Field showing faint galaxies of many colours."),
        (("What are the bright smudges in the image?", "Distant galaxies."),
         ("Which telescope took this image?", "The Hubble Space Telescope."),
         ("What colour is the background?", "Black.")),
    ),
    Photo(
        "retina", _skimage("retina"), "scikit-image data.retina (Wikimedia Commons fundus photograph)",
        "CC0",
        ("A fundus photograph of a healthy human retina with branching blood vessels.",
         "The back of an eye: an orange retina, the optic disc and red vessels.",
         "Medical image of a left eye's retina taken through the pupil."),
        (("What part of the body is shown?", "The retina at the back of an eye."),
         ("What are the dark red lines?", "Retinal blood vessels."),
         ("Where do the vessels converge?", "At the optic disc.")),
    ),
    Photo(
        "motorcycle_left", _motorcycle(0), "scikit-image data.stereo_motorcycle left view (Middlebury 2014)",
        "scikit-image sample data, research use",
        ("A red motorcycle parked indoors, seen from the left camera of a stereo pair.",
         "A sport motorcycle in a room with cluttered shelves behind it.",
         "Left view of a motorbike photographed for stereo depth estimation."),
        (("What vehicle is in the picture?", "A motorcycle."),
         ("Is the motorcycle moving?", "No, it is parked."),
         ("What is this image used for?", "Stereo depth estimation, as the left view.")),
    ),
    Photo(
        "motorcycle_right", _motorcycle(1), "scikit-image data.stereo_motorcycle right view (Middlebury 2014)",
        "scikit-image sample data, research use",
        ("The same parked motorcycle seen from the right camera of a stereo pair.",
         "A motorbike indoors with a toolbox and shelves in the background.",
         "Right view of a motorcycle used in a stereo matching benchmark."),
        (("How many wheels does the vehicle have?", "Two."),
         ("Is this photo taken outdoors?", "No, indoors."),
         ("Which camera of the stereo pair took this view?", "The right camera.")),
    ),
    Photo(
        "immunohistochemistry", _skimage("immunohistochemistry"),
        "scikit-image data.immunohistochemistry", "no known copyright restrictions",
        ("A microscope image of tissue stained brown and blue by immunohistochemistry.",
         "Stained cells under a microscope, with brown DAB staining and blue nuclei.",
         "A histology slide showing cells with a hematoxylin counterstain."),
        (("What kind of image is this?", "A stained tissue sample under a microscope."),
         ("What colour are the stained nuclei?", "Blue."),
         ("What technique stained the tissue?", "Immunohistochemistry.")),
    ),
    Photo(
        "camera", _skimage("camera"), "scikit-image data.camera (Lav Varshney)", "CC0",
        ("A black-and-white photograph of a person operating a camera on a tripod.",
         "A greyscale image of a photographer standing behind a tripod camera.",
         "A classic test image of a cameraman outdoors."),
        (("Is the image in colour?", "No, it is greyscale."),
         ("What is the person using?", "A camera on a tripod."),
         ("Is the scene indoors?", "No, outdoors.")),
    ),
    Photo(
        "coins", _skimage("coins"), "scikit-image data.coins (Brooklyn Museum collection)",
        "no known copyright restrictions",
        ("Greek coins from Pompeii laid out in rows on a dark background.",
         "A greyscale photograph of two dozen ancient coins.",
         "Rows of old round coins photographed from above."),
        (("What objects are shown?", "Ancient coins."),
         ("How are the coins arranged?", "In rows."),
         ("Is the photo in colour?", "No, it is greyscale.")),
    ),
    Photo(
        "moon", _skimage("moon"), "scikit-image data.moon", "scikit-image sample data",
        ("The surface of the moon with craters, in greyscale.",
         "A low-contrast image of lunar craters and plains.",
         "A close view of the cratered surface of the moon."),
        (("What celestial body is shown?", "The moon."),
         ("What are the round depressions?", "Craters."),
         ("Is the image in colour?", "No.")),
    ),
    Photo(
        "page", _skimage("page"), "scikit-image data.page", "scikit-image sample data",
        ("A page of printed text about region-based segmentation, with uneven lighting.",
         "A greyscale scan of a book page with several lines of text.",
         "Printed text photographed with a shadow across the page."),
        (("What does the image contain?", "A page of printed text."),
         ("Is the lighting even?", "No, one side is darker."),
         ("Is the text handwritten?", "No, it is printed.")),
    ),
    Photo(
        "text", _skimage("text"), "scikit-image data.text (Wikimedia Commons)", "public domain",
        ("Handwritten mathematical formulas on paper, photographed at an angle.",
         "A greyscale close-up of handwritten equations.",
         "Pencil notes with symbols and fractions on a sheet of paper."),
        (("What is shown in the image?", "Handwritten mathematical formulas."),
         ("Is the text printed?", "No, it is handwritten."),
         ("Is the photo in colour?", "No, greyscale.")),
    ),
    Photo(
        "china", _sklearn("china.jpg"), "scikit-learn load_sample_image('china.jpg')", "CC-BY 2.0",
        ("A multi-storey Chinese pagoda with red and green eaves on a hill above a lake.",
         "A traditional tower with tiered roofs among trees, a lake in the distance.",
         "An ornate pagoda against a pale blue sky, seen from a hillside."),
        (("What kind of building is shown?", "A multi-storey Chinese pagoda."),
         ("What lies in the distance?", "A lake."),
         ("What surrounds the building?", "Trees.")),
    ),
    Photo(
        "flower", _sklearn("flower.jpg"), "scikit-learn load_sample_image('flower.jpg')", "CC-BY 2.0",
        ("An orange pom-pom flower in close-up against a blue-green background.",
         "Macro photograph of a round flower with many layered orange petals.",
         "A single bright orange flower in full bloom."),
        (("What is in the photo?", "An orange flower."),
         ("How many flowers are in focus?", "One."),
         ("What colour is the background?", "Blue-green.")),
    ),
)
