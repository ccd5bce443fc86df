//! Errors of the tokenizer component, split by whose fault they are.

/// What went wrong; [`TokenizerError::is_client_error`] tells a 400 from a start-up/500 failure.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The model directory or file could not be read or parsed (a start-up error).
    #[error("tokenizer load failed for {path}: {reason}")]
    Load { path: String, reason: String },
    /// The model has no chat template, so chat requests cannot be tokenized.
    #[error("the model's tokenizer_config.json has no chat_template")]
    NoChatTemplate,
    /// The template does not compile (a start-up error: the model directory is broken).
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// Rendering failed for this request (the template raised, or the messages do not fit it).
    #[error("chat template failed for this request: {0}")]
    TemplateRender(String),
    /// Encoding or decoding failed for this input.
    #[error("tokenizer failed: {0}")]
    Codec(String),
}

impl TokenizerError {
    /// True when the request's input caused it (answer 400), false for configuration faults.
    pub fn is_client_error(&self) -> bool {
        matches!(self, Self::TemplateRender(_) | Self::Codec(_) | Self::NoChatTemplate)
    }
}
