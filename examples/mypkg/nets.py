"""A small convolutional classifier: a plain nn.Module, no amp-runner base class."""

from torch import nn


class StripeNet(nn.Module):
    def __init__(self, width: int = 16, num_classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, stride=2),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, image):
        return self.head(self.features(image).mean((2, 3)))
