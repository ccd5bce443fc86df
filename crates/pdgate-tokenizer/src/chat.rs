//! The model's chat template (`tokenizer_config.json`'s `chat_template`) rendered with minijinja,
//! set up the way Hugging Face's `apply_chat_template` sets up Jinja: `trim_blocks`,
//! `lstrip_blocks`, Python string/dict methods, `raise_exception`, and a `tojson` that writes JSON
//! as Python's `json.dumps` does.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use crate::error::TokenizerError;
use crate::pyjson;

const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";

/// One model's chat template(s), compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    names: Vec<String>,
    bos_token: String,
    eos_token: String,
}

/// The variables one request renders with.
#[derive(Debug, Clone, Default)]
pub struct ChatTemplateInputs<'a> {
    /// The OpenAI `messages` array as sent.
    pub messages: &'a [Json],
    pub add_generation_prompt: bool,
    /// The OpenAI `tools` array, when the request has one.
    pub tools: Option<&'a [Json]>,
    /// Extra variables (`chat_template_kwargs`), e.g. `enable_thinking`.
    pub extra: Option<&'a serde_json::Map<String, Json>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("names", &self.names).finish()
    }
}

impl ChatTemplate {
    /// Compiles `chat_template` as found in `tokenizer_config.json`: a string, or a list of
    /// `{"name", "template"}` objects.
    pub fn from_config_value(value: &Json, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        let named: Vec<(String, String)> = match value {
            Json::String(s) => vec![(DEFAULT_NAME.to_owned(), s.clone())],
            Json::Array(items) => items
                .iter()
                .map(|item| match (item.get("name").and_then(Json::as_str), item.get("template").and_then(Json::as_str)) {
                    (Some(n), Some(t)) => Ok((n.to_owned(), t.to_owned())),
                    _ => Err(TokenizerError::TemplateSyntax("a chat_template list entry lacks a string name or template".into())),
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(TokenizerError::TemplateSyntax("chat_template is neither a string nor a list".into())),
        };
        if named.is_empty() {
            return Err(TokenizerError::NoChatTemplate);
        }
        let mut env = hf_environment()?;
        let mut names = Vec::with_capacity(named.len());
        for (name, source) in named {
            env.add_template_owned(name.clone(), source).map_err(|e| TokenizerError::TemplateSyntax(format!("{name}: {e:#}")))?;
            names.push(name);
        }
        Ok(Self { env, names, bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned() })
    }

    /// Compiles a single template string.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        Self::from_config_value(&Json::String(source.to_owned()), bos_token, eos_token)
    }

    /// Which template a request uses: `tool_use` when tools are given and one exists, else
    /// `default`, else the only one (as `transformers` chooses).
    fn pick(&self, has_tools: bool) -> Result<&str, TokenizerError> {
        let find = |n: &str| self.names.iter().find(|x| x.as_str() == n).map(String::as_str);
        if has_tools {
            if let Some(n) = find(TOOL_USE_NAME) {
                return Ok(n);
            }
        }
        find(DEFAULT_NAME)
            .or_else(|| (self.names.len() == 1).then(|| self.names[0].as_str()))
            .ok_or_else(|| TokenizerError::TemplateRender(format!("no default chat template among {:?}", self.names)))
    }

    /// Renders the prompt text for one request.
    pub fn render(&self, inputs: &ChatTemplateInputs<'_>) -> Result<String, TokenizerError> {
        let name = self.pick(inputs.tools.is_some_and(|t| !t.is_empty()))?;
        let template = self.env.get_template(name).map_err(|e| TokenizerError::TemplateSyntax(e.to_string()))?;
        let mut ctx = serde_json::Map::new();
        if let Some(extra) = inputs.extra {
            ctx.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        ctx.insert("messages".into(), Json::Array(inputs.messages.to_vec()));
        ctx.insert("add_generation_prompt".into(), Json::Bool(inputs.add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        if let Some(tools) = inputs.tools {
            ctx.insert("tools".into(), Json::Array(tools.to_vec()));
        }
        template.render(Value::from(minijinja::value::Serde(&ctx))).map_err(|e| TokenizerError::TemplateRender(render_message(&e)))
    }
}

/// The message a client sees: the template's own `raise_exception` text when it raised.
fn render_message(e: &Error) -> String {
    match e.kind() {
        ErrorKind::InvalidOperation => e.detail().map_or_else(|| e.to_string(), str::to_owned),
        _ => format!("{e:#}"),
    }
}

fn hf_environment() -> Result<Environment<'static>, TokenizerError> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().map_err(|e| TokenizerError::TemplateSyntax(e.to_string()))?;
    env.set_syntax(syntax);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_filter("tojson", tojson);
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Hugging Face's `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`, not HTML-escaped.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(pyjson::dumps(&json, indent)))
}
